"""MemPO core library: wire records, agent format, rewards, advantages, losses, the Redis
queue, the synthetic world and the tiny model. Every service imports it; it imports no
service (except the CLI, which mounts each service's commands)."""

__version__ = "0.1.0"
