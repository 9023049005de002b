"""The local stand-ins for real data and models: the synthetic world of entities and
facts (its questions, its corpus), the oracle agent, the word lists, and the tiny
Qwen2-architecture policy with its pretraining (the shipped build in ``assets/``).

Used by the services' zero-setup defaults (the built-in corpus and task set, the tiny
model), by the launcher and by the tests; never needed with real data and a real model.
"""
