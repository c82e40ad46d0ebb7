"""The main job end to end: an RL loop trains a LoRA and syncs it into a real vLLM or SGLang server
every step. The server must sample from exactly the policy the trainer pushed (its log-probs of
the sampled tokens match the trainer's), and the reward must rise with syncing and not without.
A rise of 0.3 is asked, against under 0.1 without syncing. vLLM's run is reproducible from the
seed: its reward passes 0.88 by step 10 from about 0.12, so 14 steps leave a wide margin.
SGLang's sampling is not: 24 steps usually end above 0.9, but one CI run ended at 0.48
(on-policy throughout: the same log-prob check passed)."""
import pytest

from examples.rl_loop import LoopConfig, run, summary


ON_POLICY = 1e-3  # mean |trainer - server| log-prob; float32 on both sides measures ~1e-6


def loop(server, model_dir, workdir, transport, name, steps):
    cfg = LoopConfig(steps=steps, transport=transport, name=name, model_dir=str(model_dir),
                     server_url=server.url, engine=server.engine, api_key=server.api_key,
                     out_dir=str(workdir / "rl" / server.engine), progress=False)
    return run(cfg)


# One engine per transport; every transport's token identity with the disk load is checked
# on both engines by test_tensors/test_shm/test_broadcast, so the broadcast loop is extended
# (CI time).
STEPS = {"vllm": 14, "sglang": 24}


@pytest.mark.parametrize("engine,transport", [
    ("vllm", "shm"), pytest.param("vllm", "broadcast", marks=pytest.mark.extended),
    ("sglang", "tensors")])
def test_reward_rises_when_lora_is_synced(request, model_dir, workdir, engine, transport):
    server = request.getfixturevalue(engine)
    log = loop(server, model_dir, workdir, transport, f"rl-{transport}", steps=STEPS[engine])
    first, last = summary(log, k=3)
    mismatch = max(s["logprob_mismatch"] for s in log["steps"])
    print(f"\n{server.engine} {transport}: reward first 3 steps {first:.3f}, last 3 steps "
          f"{last:.3f}, worst log-prob mismatch {mismatch:.1e}")
    assert mismatch < ON_POLICY, [s["logprob_mismatch"] for s in log["steps"]]
    assert last > first + 0.3
    # Rollouts were served by the version the trainer had just pushed (on-policy).
    versions = [s["rollout_version"] for s in log["steps"]]
    assert versions == list(range(versions[0], versions[0] + len(versions)))
    assert (workdir / "rl" / server.engine / f"reward_{transport}.png").stat().st_size > 0


def test_reward_flat_without_sync(vllm, model_dir, workdir):
    server = vllm
    log = loop(server, model_dir, workdir, "none", "rl-none", steps=12)
    first, last = summary(log, k=3)
    print(f"\n{server.engine} no sync: reward first 3 steps {first:.3f}, last 3 steps {last:.3f}")
    assert last < first + 0.1
    # The mismatch check can fail: the trainer drifts away from the policy the server kept.
    assert log["steps"][0]["logprob_mismatch"] < ON_POLICY
    assert min(s["logprob_mismatch"] for s in log["steps"][2:]) > 100 * ON_POLICY
    assert len({s["rollout_version"] for s in log["steps"]}) == 1
