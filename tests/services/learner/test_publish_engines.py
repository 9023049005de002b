"""A publish from the real trainer reaches two real CPU engines and the real scorer."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from mempo.keys import Keys
from mempo.queue import RedisQueue
from mempo.registry import EngineInfo
from services.learner.checkpoint import TrainerExporter
from services.learner.publish import WeightPublisher
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from services.rollout.engine.app import create_app as create_engine
from services.rollout.engine.settings import EngineSettings
from services.scorer.app import create_app as create_scorer
from services.scorer.settings import ScorerSettings
from tests.services.learner.service_support import serving

TOKEN = "publish-token"


async def test_engines_and_scorer_load_the_published_version(
    redis_client: object, keys: Keys, tmp_path: Path, tiny_model_dir: Path
) -> None:
    root = tmp_path / "weights"
    common = {"model_path": str(tiny_model_dir), "weights_root": str(root), "admin_token": TOKEN}
    apps = [create_engine(EngineSettings(**common)) for _ in range(2)]  # type: ignore[arg-type]
    apps.append(create_scorer(ScorerSettings(device="cpu", **common)))  # type: ignore[arg-type]
    trainer = Trainer(TrainerConfig(beta_kl=0.0), tiny_model_dir)
    with torch.no_grad():  # a policy that differs from the engines' initial weights
        trainer.policy.model.embed_tokens.weight.mul_(0.5)  # type: ignore[union-attr]
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    with serving(apps) as urls:
        for i, url in enumerate(urls):
            role = "scorer" if i == 2 else "rollout"
            await queue.register_engine(EngineInfo(id=f"e{i}", role=role, url=url).signed(TOKEN), ttl_s=120)
        publisher = WeightPublisher(queue, root, admin_token=TOKEN, timeout_s=60)
        try:
            report = await publisher.publish(TrainerExporter(trainer), version=1)
        finally:
            await publisher.aclose()
        async with httpx.AsyncClient(timeout=30) as http:
            infos = [(await http.get(f"{url}/model_info")).json() for url in urls]
            prompt = [5, 17, 42, 99]
            generated = await http.post(
                f"{urls[0]}/generate",
                json={
                    "input_ids": prompt,
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                    "return_logprob": True,
                },
            )
    assert report.stale == {} and report.updated == sorted(urls)
    assert [info["weight_version"] for info in infos] == ["1", "1", "1"]
    # the engine now serves the trainer's weights: its greedy token's log-prob matches
    body = generated.json()
    logprob, token = body["meta_info"]["output_token_logprobs"][0][:2]
    with torch.no_grad():
        logits = trainer.policy(torch.tensor([prompt])).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1)
    assert token == int(expected.argmax())
    assert abs(logprob - float(expected[token])) < 1e-4
