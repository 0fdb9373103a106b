"""shardsync on a Ray cluster (``pip install shardsync[ray]``): producers inside existing trainer actors, engines
that find them by the sync group's name — addresses and the group's token travel through Ray, no fixed ports.

    # in each trainer actor (rank r of n):
    producer = start_producer(source, group="policy", rank=r, n_producers=n, n_consumers=4)
    producer.init(); producer.sync(version)
    # for a vLLM engine (pull mode):
    llm.init_weight_transfer_engine(dict(init_info=engine_init_info("policy")))
    # or any engine of your own:
    consumer = start_consumer("replica0/rank0", group="policy", record=..., apply=...)
    # in the driver: a dead engine actor is dropped at once, not after its lease
    watch = EngineWatch("policy"); watch.watch(engine_actor, ["replica0/rank0"])
"""

from .helpers import engine_init_info, start_consumer, start_producer
from .registry import forget, lookup, publish
from .watch import EngineWatch

__all__ = ["start_producer", "start_consumer", "engine_init_info", "publish", "lookup", "forget", "EngineWatch"]
