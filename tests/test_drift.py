"""The drift check (scripts/drift_check.py) against real engine releases and doctored sources;
no servers. Wheels are cached in ~/.cache/lora-sync/wheels (LORA_SYNC_WHEEL_CACHE)."""
from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest

from lora_sync.server.pins import SUPPORTED, require_supported

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("drift_check", REPO / "scripts" / "drift_check.py")
drift = sys.modules["drift_check"] = importlib.util.module_from_spec(_spec)  # dataclasses need it
_spec.loader.exec_module(drift)


def _registry_reachable() -> bool:
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    try:
        urllib.request.urlopen(f"{index}/pip/", timeout=10).close()
        return True
    except OSError:
        return False


def _wheel_or_skip(target):
    try:
        return drift.fetch_wheel(target.dist, target.version)
    except RuntimeError as e:
        if _registry_reachable():
            raise  # the registry answered: a real failure, not a missing network
        pytest.skip(f"package registry unreachable, cannot download {target.label}: {e}")


@pytest.mark.parametrize("spec", drift.supported_targets())
def test_supported_versions_have_every_symbol(spec):
    target = drift.parse_target(spec)
    target.path = _wheel_or_skip(target)
    result = drift.check_target(target)
    assert result.failures == []
    assert any(ok for ok, _ in result.cells.values())
    # The committed report covers this version and today's lists (rerun the script if not).
    doc = (REPO / "docs" / "engine_drift.md").read_text()
    assert f" {target.label} |" in doc
    assert all(f"| `{text}` |" in doc for text in result.cells)


def _site_packages() -> Path:
    spec = importlib.util.find_spec("vllm")  # locates, does not import
    if spec is None:
        pytest.skip("vllm is not installed in this environment")
    return Path(spec.origin).parent.parent


def _installed_vllm_version(site: Path) -> str:
    for meta in site.glob("vllm*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            if line.startswith("Version: "):
                return line.split()[1].split("+")[0]
    pytest.skip("no vllm dist-info found")


class RecordingTree(drift.SourceTree):
    """Remembers which source files a check read, to copy only those."""

    def __init__(self, path):
        super().__init__(path)
        self.read = set()

    def _read(self, rel):
        text = super()._read(rel)
        if text is not None:
            self.read.add(rel)
        return text


def _remove_method(path: Path, cls: str, name: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    for node in ast.walk(ast.parse("".join(lines))):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    del lines[item.lineno - 1 - len(item.decorator_list):item.end_lineno]
                    path.write_text("".join(lines))
                    return
    raise AssertionError(f"{cls}.{name} not found in {path}")


def test_a_missing_symbol_fails_naming_it(tmp_path, capsys):
    site = _site_packages()
    version = _installed_vllm_version(site)
    # The installed vLLM passes; the files that check read are all a doctored copy needs.
    tree = RecordingTree(site)
    resolver = drift.Resolver(tree)
    api = drift.ENGINE_FILES["vllm"]
    for e in drift.touched(api):
        if e.applies(version):
            assert drift.check_entry(resolver, e)[0], e.text
    assert all(ok for ok, _ in drift.mirror_cells(resolver, api, version).values())
    for rel in tree.read:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(site / rel, tmp_path / rel)
    assert drift.main([f"vllm=={version}@{tmp_path}"]) == 0

    _remove_method(tmp_path / "vllm/lora/model_manager.py", "LoRAModelManager",
                   "_validate_modules_to_save")
    assert drift.main([f"vllm=={version}@{tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "LRUCacheLoRAModelManager._validate_modules_to_save(lora_model)" in err
    assert "no attribute or method `_validate_modules_to_save` in LRUCacheLoRAModelManager" \
        in err
    assert err.count("DRIFT:") == 1, err


def test_a_loader_check_missing_from_the_table_fails(tmp_path):
    """BY_VERSION must list every check vLLM's own loader runs, not only existing ones."""
    site = _site_packages()
    version = _installed_vllm_version(site)
    api = _doctored_api(tmp_path, '"_validate_token_classification_lora")', ")")
    result = drift.check_target(drift.Target("vllm", version, site), api_file=api)
    [failure] = result.failures
    assert "'lora_checks'" in failure and "release calls" in failure, failure


@pytest.mark.parametrize("engine", sorted(drift.ENGINE_FILES))
def test_lists_cover_every_engine_touch(engine):
    assert drift.coverage_problems(drift.ENGINE_FILES[engine], engine) == []


def _doctored_api(tmp_path, old: str, new: str) -> Path:
    text = drift.ENGINE_FILES["vllm"].read_text()
    assert old in text
    path = tmp_path / "engine_api.py"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize("old,new,problem", [
    ("    return lora\n", "    lora._secret_cache = None\n    return lora\n",
     "private attribute `._secret_cache`"),
    ("    from vllm.lora.peft_helper import PEFTHelper\n",
     "    from vllm.lora.peft_helper import PEFTHelper\n    from vllm.lora.utils import x\n",
     "`from vllm.lora.utils import x` is not in TOUCHED"),
    ("    return lora\n", "    getattr(manager, '_hidden')\n    return lora\n",
     "private name '_hidden'"),
    # TOUCHED names this validator for 0.33.0 only: using it with 0.32.0 must be listed too.
    ('"_validate_modules_to_save",', '"_validate_classification_head_lora",',
     "BY_VERSION['0.32.0'] uses '_validate_classification_head_lora'"),
])
def test_an_unlisted_touch_fails(tmp_path, old, new, problem):
    problems = drift.coverage_problems(_doctored_api(tmp_path, old, new), "vllm")
    assert len(problems) == 1 and problem in problems[0], problems


def test_version_table_matches_the_pins(monkeypatch):
    from vllm_ext import engine_api
    assert set(engine_api.BY_VERSION) == set(SUPPORTED["vLLM"])
    monkeypatch.delenv("LORA_SYNC_ALLOW_UNTESTED_ENGINE", raising=False)
    for engine, versions in SUPPORTED.items():
        for v in versions:
            assert require_supported(engine, v) == v
        with pytest.raises(RuntimeError) as e:
            require_supported(engine, "9.9.9")
        # The refusal says how each supported version was tested.
        assert all(f"{v}: {how}" in str(e.value) for v, how in versions.items())


@pytest.mark.parametrize("installed,row", [("0.32.0", "0.32.0"), ("0.33.0", "0.33.0"),
                                           ("0.34.0", "0.33.0")])  # overridden: newest row
def test_build_lora_model_runs_that_release_checks(monkeypatch, installed, row):
    vllm = pytest.importorskip("vllm")
    from vllm.config.lora import LoRAConfig

    from vllm_ext import engine_api
    calls, built = [], {}

    class AdapterManager:
        model = object()

        def __getattr__(self, name):
            assert name.startswith("_validate_"), name
            return lambda lora: calls.append(name)

    class LoRAModel:
        @staticmethod
        def from_lora_tensors(**kw):
            built.update(kw)
            return "lora"

    class Manager:
        _adapter_manager, _lora_model_cls = AdapterManager(), LoRAModel
        lora_config, vocab_size, max_position_embeddings = LoRAConfig(max_lora_rank=8), 99, 64

    monkeypatch.setattr(vllm, "__version__", installed)
    engine_api.release.cache_clear()
    try:
        lora = engine_api.build_lora_model(Manager(), 7, {}, {"r": 8, "lora_alpha": 16,
                                                             "target_modules": ["q_proj"]})
    finally:
        engine_api.release.cache_clear()
    assert lora == "lora" and built["lora_model_id"] == 7 and built["device"] == "cpu"
    assert tuple(calls) == engine_api.BY_VERSION[row]["lora_checks"]


@pytest.mark.parametrize("old,new,problem", [
    # an override of another private TRL method
    ("    def _init_lora_sync(self, model) -> bool:\n",
     "    def _save_checkpoint(self, model, trial):\n        pass\n\n"
     "    def _init_lora_sync(self, model) -> bool:\n",
     "method `AsyncGRPOTrainer._save_checkpoint`"),
    # TRL's own `_lora_sync` attribute: our `_lora_sync` prefix must not excuse it here
    ("        self._lora_name = self.lora_sync_name\n",
     "        self._lora_name = self.lora_sync_name\n        self._lora_sync = True\n",
     "private attribute `._lora_sync`"),
])
def test_an_unlisted_trl_touch_fails(tmp_path, old, new, problem):
    text = drift.ENGINE_FILES["trl"].read_text()
    assert old in text
    path = tmp_path / "trl.py"
    path.write_text(text.replace(old, new, 1))
    problems = drift.coverage_problems(path, "trl")
    assert len(problems) == 1 and problem in problems[0], problems
