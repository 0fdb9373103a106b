"""Every group-wide setting (``config.GroupSettings``) is declared once and reaches every surface a user configures
shardsync through: the own API (``ProducerConfig``, ``Consumer``), vLLM's trainer and worker init infos (through the
payload the trainer sends its workers), verl's checkpoint engine (through its topology) and the Ray helpers (through
the group registry). Each field gets a value that is not its default at the surface and must arrive, unchanged,
where the producer's and the consumer's runtime read it; every further ``ProducerConfig`` field is reachable from
every trainer surface too."""

from __future__ import annotations

import dataclasses

import pytest

from shardsync.config import ALIASES, GROUP_FIELDS, GroupSettings, settings_of
from shardsync.engine.producer.producer_config import PRODUCER_FIELDS, ProducerConfig

SENTINELS = {"token": "sentinel-token", "transport": "nixl", "transport_kwargs": {"sentinel": 1}, "timeout_s": 7.5,
             "init_timeout_s": 8.5, "lease_s": 3.5, "verify_checksums": True, "mac": True, "delta": True,
             "max_frame_bytes": 12_345_678, "switch_interval_s": 0.003,
             "sync_memory_bytes": 7_654_321}


def test_every_setting_has_a_sentinel_unlike_its_default():
    assert set(SENTINELS) == set(GROUP_FIELDS), "a new group setting needs its sentinel here"
    defaults = GroupSettings()
    for f in GROUP_FIELDS:
        assert getattr(defaults, f) != SENTINELS[f], f
    assert set(ALIASES.values()) <= set(GROUP_FIELDS)


def _one(field: str) -> dict:
    return {field: SENTINELS[field]}


@pytest.mark.parametrize("field", GROUP_FIELDS)
def test_producer_config(field):
    cfg = ProducerConfig(rank=0, n_producers=1, n_consumers=1, **_one(field))
    assert getattr(settings_of(cfg), field) == SENTINELS[field]


class _Made:
    def __init__(self, name, kw):
        self.name, self.kw = name, kw


@pytest.mark.parametrize("field", GROUP_FIELDS)
def test_consumer(field, monkeypatch):
    from shardsync.engine.consumer import consumer as mod

    monkeypatch.setattr(mod, "make_group_transport", lambda name, **kw: _Made(name, kw))  # no sockets: what it gets
    c = mod.Consumer("c0", "127.0.0.1:1", record=lambda metas: None, apply=lambda g, b: None, **_one(field))
    assert getattr(c.settings, field) == SENTINELS[field]
    if field == "transport":
        assert c.transport.name == "nixl"
    if field == "transport_kwargs":
        assert c.transport.kw["sentinel"] == 1
    again = mod.Consumer("c1", "127.0.0.1:1", record=lambda metas: None, apply=lambda g, b: None,
                         settings=GroupSettings(**_one(field)))
    assert again.settings == c.settings


def test_consumer_names_an_unknown_setting():
    from shardsync.engine.consumer.consumer import Consumer

    with pytest.raises(TypeError, match="tiemout_s"):
        Consumer("c0", "127.0.0.1:1", record=lambda m: None, apply=lambda g, b: None, tiemout_s=3)
    with pytest.raises(TypeError, match="require_mac.*mac"):
        Consumer("c0", "127.0.0.1:1", record=lambda m: None, apply=lambda g, b: None, require_mac=True, mac=False)


@pytest.mark.parametrize("field", GROUP_FIELDS)
def test_vllm_trainer_and_worker_init_infos(field):
    from shardsync.integrations.vllm.trainer_backend import (ShardsyncTrainerInitInfo, producer_config,
                                                             worker_init_info)
    from shardsync.integrations.vllm.worker_backend import ShardsyncInitInfo

    info = ShardsyncTrainerInitInfo(rank=0, **_one(field))
    cfg = producer_config(info, rank=0, n_producers=1)
    if field != "token":  # rank 0 generates a token unless given one, and hands it on (below)
        assert getattr(settings_of(cfg), field) == SENTINELS[field]
    payload = worker_init_info(info, coordinator=("127.0.0.1", 1), token=info.token or "generated", session="s",
                               start_version=0)
    worker = ShardsyncInitInfo(**payload)
    assert getattr(settings_of(worker), field) == SENTINELS[field]


def test_vllm_worker_info_takes_the_old_names():
    from shardsync.integrations.vllm.worker_backend import ShardsyncEngine

    info = ShardsyncEngine.__new__(ShardsyncEngine).parse_init_info({"coordinator": ["127.0.0.1", 1], "token": "t", "require_mac": True})
    assert info.mac is True


@pytest.mark.parametrize("field", PRODUCER_FIELDS)
def test_every_producer_field_reaches_from_the_vllm_trainer_api(field):
    from shardsync.integrations.vllm.trainer_backend import ShardsyncTrainerInitInfo, producer_config

    own = {f.name for f in dataclasses.fields(ShardsyncTrainerInitInfo)}
    value = object()
    if field in own or field in ("rank", "n_producers", "n_consumers", "host", "advertise_host", "port",
                                 "coordinator"):
        return  # a field of the info itself, or what the trainer's rank and addresses decide
    cfg = producer_config(ShardsyncTrainerInitInfo(rank=0, producer_options={field: value}), rank=0, n_producers=1)
    assert getattr(cfg, field) is value


def test_vllm_producer_options_refuse_unknown_and_group_names():
    from shardsync.integrations.vllm.trainer_backend import ShardsyncTrainerInitInfo, producer_config

    for bad in ("nonsense", "mac"):
        with pytest.raises(TypeError, match=bad):
            producer_config(ShardsyncTrainerInitInfo(rank=0, producer_options={bad: 1}), rank=0, n_producers=1)


def _verl_topology(master_kw: dict):
    from shardsync.integrations.verl.backend import ShardsyncCheckpointEngine as E

    master, rollout = E(1 << 20, is_master=True, **master_kw), E(1 << 20)
    try:
        tkw, rkw = E.build_topology(1, 1, [master.prepare()])
        master.init_process_group(**{k: v[0] for k, v in tkw.items()})
        rollout.init_process_group(**{k: v[0] for k, v in rkw.items()})
        return master, rollout
    except BaseException:
        master.close()
        raise


@pytest.mark.parametrize("field", GROUP_FIELDS)
def test_verl_checkpoint_engine(field):
    master, rollout = _verl_topology(_one(field))
    try:
        cfg = master.producer_config(master.topology, coordinator=None)
        assert getattr(settings_of(cfg), field) == SENTINELS[field]
        # a rollout worker runs with the trainer master's settings, whatever its own engine kwargs
        assert getattr(rollout.group_settings(rollout.topology), field) == SENTINELS[field]
    finally:
        master.close()


@pytest.mark.parametrize("field", PRODUCER_FIELDS)
def test_every_producer_field_reaches_from_verl(field):
    from shardsync.integrations.verl.backend import _RESERVED

    if field in _RESERVED or field in ("advertise_host", "port", "device"):
        return  # the topology's, verl's bucket size, the engine's own ``device``
    value = object()
    master, _ = _verl_topology({field: value})
    try:
        assert getattr(master.producer_config(master.topology, coordinator=None), field) is value
    finally:
        master.close()


@pytest.mark.parametrize("field", GROUP_FIELDS)
def test_ray_helpers(field):
    from shardsync.integrations.ray.helpers import consumer_settings, group_entry, producer_config
    from shardsync.integrations.vllm.worker_backend import ShardsyncInitInfo

    cfg0 = producer_config(_one(field), rank=0, n_producers=2, n_consumers=1, host="127.0.0.1")
    assert getattr(settings_of(cfg0), field) == SENTINELS[field]
    entry = group_entry(cfg0, ("127.0.0.1", 1))
    cfg1 = producer_config({}, rank=1, n_producers=2, n_consumers=1, host="127.0.0.1", registry=entry)
    assert getattr(settings_of(cfg1), field) == SENTINELS[field]
    settings, rest = consumer_settings(entry, {"node": "n"})
    assert getattr(settings, field) == SENTINELS[field] and rest == {"node": "n"}
    engine = ShardsyncInitInfo(**{**entry["settings"], "coordinator": entry["coordinator"]})  # engine_init_info
    assert getattr(settings_of(engine), field) == SENTINELS[field]


@pytest.mark.parametrize("field", PRODUCER_FIELDS)
def test_every_producer_field_reaches_from_ray(field):
    from shardsync.integrations.ray.helpers import _RESERVED, producer_config

    if field in _RESERVED:
        return
    value = object()
    cfg = producer_config({field: value}, rank=0, n_producers=1, n_consumers=1, host="127.0.0.1")
    assert getattr(cfg, field) is value
