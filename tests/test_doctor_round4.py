"""Issue 59: refusals wherever the engine runs them (helpers, other modules, properties, loops, match, walrus,
constant expressions) and refusals behind an environment variable said aloud (tests/engine_pair/round4,
tests/engine_pair/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdraft.doctor.refusals.check import new_refusals
from specdraft.doctor.source.reader import SourceTree
from specdraft.engine.contract import Contract
from specdraft.engine.formats import ConfigReader, ExportFormat
from specdraft.engine.usage import OptionKeys

PAIRS_DIR = Path(__file__).parent / "engine_pair"

#: the export every release pair reads (round3's and round4's): what `specdraft export` writes, in short
EXPORT = {
    "speculators_model_type": "eagle3",
    "draft_vocab_size": 8192,
    "target_hidden_size": 64,
    "norm_before_residual": False,
    "eagle_aux_hidden_state_layer_ids": [1, 5, 9],
    "speculators_config": {
        "proposal_methods": [{"speculative_tokens": 3}],
        "verifier": {"name_or_path": "org/target"},
    },
}
CONTRACT = Contract(
    engine="fakeengine",
    entries=(),
    option_keys=(
        OptionKeys(
            "speculative_config",
            keys=("method", "num_speculative_tokens"),
            values=(("method", "eagle3"),),
            passed=(("num_speculative_tokens", 3),),
            config_class="fakeengine.config:SpeculativeConfig",
        ),
    ),
    formats=(
        ExportFormat(
            name="speculators",
            engine="fakeengine",
            sample=EXPORT,
            readers=(ConfigReader("fakeengine.speculators:load", ("config_dict",)),),
        ),
    ),
)

#: release -> what the refusal it adds is for our values: a break, a true negative ("pass"), or "env" (a
#: refusal an environment variable turns on, said as a warning naming it)
ROUND4 = {
    "helper": "break",  # _check_vocab(8192): 8192 > 4096 in the helper
    "helper_ok": "pass",  # 8192 > 65536
    "helper_guarded": "pass",  # called only when kind == "medusa"
    "module": "break",  # checks.validate_hidden(config_dict): 64 % 128
    "module_ok": "pass",  # 64 % 32
    "imported": "break",  # validate_layers([1, 5, 9]): 9 >= 8 (the last element, not the first)
    "imported_ok": "pass",  # any of [1, 5, 9] >= 64
    "match": "break",  # case "eagle" | "eagle3"
    "match_ok": "pass",  # case "medusa"
    "match_guard": "break",  # case "eagle3" if 3 > 2 (after case "medusa")
    "match_guard_ok": "pass",  # case "eagle3" if 3 > 8
    "loop": "break",  # for layer in [1, 5, 9]: layer >= 8
    "loop_ok": "pass",  # layer >= 64
    "loop_items": "break",  # for i, m in enumerate(proposal_methods): m.get("speculative_tokens", 1) > 2
    "loop_items_ok": "pass",  # > 8
    "method": "break",  # SpeculativeConfig.__post_init__ -> self._verify_args(): eagle3 and 3 > 2
    "method_ok": "pass",  # 3 > 8
    "property": "break",  # __post_init__ reads self.uses_eagle, which refuses "eagle3"
    "property_ok": "pass",  # "eagle3" allowed
    "walrus": "break",  # (vocab := 8192) and vocab > 4096
    "walrus_ok": "pass",  # vocab > 65536
    "const_expr": "break",  # 8192 > 1 << 12
    "const_expr_ok": "pass",  # 8192 > 64 * 1024
    "env": "env",  # FAKE_STRICT_VOCAB=1 and 8192 > 4096
    "env_ok": "pass",  # FAKE_STRICT_VOCAB=1 and 8192 > 65536: passes either way
    "envs": "env",  # envs.FAKE_STRICT_LAYERS and len([1, 5, 9]) > 2
    "envs_ok": "pass",  # len([1, 5, 9]) > 8
}
#: round3's pairs (tests/test_doctor_round3.py), judged again with this contract: old and new together
ROUND3 = {
    "or_over": "break",
    "or_under": "pass",
    "len_or_short": "break",
    "len_or_long": "pass",
    "not_flag": "break",
    "not_size": "pass",
    "none_or": "break",
    "none_or_ok": "pass",
    "ifexp": "break",
    "ifexp_ok": "pass",
    "any_range": "pass",
    "all_even": "break",
    "isinstance_ok": "pass",
    "isinstance_str": "break",
    "in_set": "pass",
    "in_set_ours": "break",
    "get_default": "break",
    "chained": "break",
    "engine_state": "unknown",
}
ALL = {**{("round4", r): v for r, v in ROUND4.items()}, **{("round3", r): v for r, v in ROUND3.items()}}


def _verdict(round_: str, release: str) -> tuple[str, list]:
    root = PAIRS_DIR / round_
    found = new_refusals(
        SourceTree(root / release), SourceTree(root / "base"), CONTRACT, {"speculators": EXPORT}
    )
    (p,) = found
    if p.severity == "break":
        return "break", found
    if p.severity == "info" and p.message.endswith("our value passes it"):
        return "pass", found
    if p.severity == "warning" and "environment variable" in p.message and not p.quiet:
        return "env", found
    return ("unknown" if p.severity == "warning" else "none"), found


@pytest.mark.parametrize("release", sorted(ROUND4))
def test_each_refusal_is_found_where_the_engine_runs_it(release):
    got, found = _verdict("round4", release)
    assert got == ROUND4[release], found


def test_precision_and_recall_over_old_and_new_pairs():
    got = {k: _verdict(*k)[0] for k in ALL}
    breaks = {k for k, v in ALL.items() if v == "break"}
    found = {k for k, v in got.items() if v == "break"}
    assert len(breaks & found) / len(found) == 1.0  # precision
    assert len(breaks & found) / len(breaks) == 1.0  # recall
    assert got == ALL


def test_a_refusal_in_another_module_is_located_there():
    _, (p,) = _verdict("round4", "module")
    assert p.location == "fakeengine/checks.py:6", p
    assert "`target_hidden_size`" in p.symbol and p.passed == "target_hidden_size=64", p


def test_every_element_of_a_list_is_judged():
    """[1, 5, 9]: the first element passes `>= 8`, the last does not."""
    _, (p,) = _verdict("round4", "loop")
    assert "9" in p.passed, p


def test_a_property_run_by_post_init_is_read_on_our_option():
    _, (p,) = _verdict("round4", "property")
    assert p.location == "fakeengine/config.py:22" and p.subject == "speculative_config option", p


def test_an_environment_gate_names_the_variable_and_the_value_that_turns_it_on(monkeypatch):
    monkeypatch.delenv("FAKE_STRICT_VOCAB", raising=False)
    _, (p,) = _verdict("round4", "env")
    assert "FAKE_STRICT_VOCAB=1" in p.message and "not set here" in p.message, p
    _, (p,) = _verdict("round4", "envs")
    assert "FAKE_STRICT_LAYERS" in p.message, p


def test_an_environment_gate_set_here_is_a_break(monkeypatch):
    monkeypatch.setenv("FAKE_STRICT_VOCAB", "1")
    assert _verdict("round4", "env")[0] == "break"


def test_the_refusals_of_a_release_are_reused_until_an_environment_variable_they_read_changes(
    tmp_path, monkeypatch
):
    """`doctor --against` keeps its refusals in the cache; setting FAKE_STRICT_VOCAB judges them again."""
    from specdraft.doctor import command

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    monkeypatch.delenv("FAKE_STRICT_VOCAB", raising=False)
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(__import__("json").dumps(EXPORT))
    monkeypatch.setattr(command, "installed_root", lambda engine: PAIRS_DIR / "round4" / "base")
    calls = []
    real = command.refusal_problems
    monkeypatch.setattr(command, "refusal_problems", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run():
        return command._refusals(CONTRACT, PAIRS_DIR / "round4" / "env", str(export), "env", cache=True)

    first, second = run(), run()
    assert len(calls) == 1 and first == second and first[0].severity == "warning"
    monkeypatch.setenv("FAKE_STRICT_VOCAB", "1")
    assert run()[0].severity == "break" and len(calls) == 2


def test_a_list_too_long_to_try_every_element_never_passes():
    """300 distinct aux layer ids, all below 64: more cases than are tried, so a warning, never a pass."""
    root = PAIRS_DIR / "round4"
    long = {**EXPORT, "eagle_aux_hidden_state_layer_ids": [i / 5 for i in range(300)]}
    (p,) = new_refusals(
        SourceTree(root / "loop_ok"), SourceTree(root / "base"), CONTRACT, {"speculators": long}
    )
    assert p.severity == "warning", p
    short = {**EXPORT, "eagle_aux_hidden_state_layer_ids": [i / 5 for i in range(200)]}
    (p,) = new_refusals(
        SourceTree(root / "loop_ok"), SourceTree(root / "base"), CONTRACT, {"speculators": short}
    )
    assert p.severity == "info", p
