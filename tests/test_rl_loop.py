"""The main job end to end: an RL loop trains a LoRA and syncs it into the real vLLM server
every step. The reward must rise with syncing, and must not without it."""
import pytest

from examples.rl_loop import LoopConfig, run, summary


def loop(server, model_dir, workdir, transport, name):
    cfg = LoopConfig(steps=12, transport=transport, name=name, model_dir=str(model_dir),
                     server_url=server.url, engine=server.engine, api_key=server.api_key,
                     out_dir=str(workdir / "rl" / server.engine), progress=False)
    return run(cfg)


@pytest.mark.parametrize("transport", ["tensors", "broadcast"])
def test_reward_rises_when_lora_is_synced(server, model_dir, workdir, transport):
    log = loop(server, model_dir, workdir, transport, f"rl-{transport}")
    first, last = summary(log, k=3)
    print(f"\n{server.engine} {transport}: reward first 3 steps {first:.3f}, last 3 steps {last:.3f}")
    assert last > first + 0.25
    # Rollouts were served by the version the trainer had just pushed (on-policy).
    versions = [s["rollout_version"] for s in log["steps"]]
    assert versions == list(range(versions[0], versions[0] + len(versions)))
    assert (workdir / "rl" / server.engine / f"reward_{transport}.png").stat().st_size > 0


def test_reward_flat_without_sync(server, model_dir, workdir):
    log = loop(server, model_dir, workdir, "none", "rl-none")
    first, last = summary(log, k=3)
    print(f"\n{server.engine} no sync: reward first 3 steps {first:.3f}, last 3 steps {last:.3f}")
    assert last < first + 0.1
    assert len({s["rollout_version"] for s in log["steps"]}) == 1
