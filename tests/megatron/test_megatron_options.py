"""Every TransformerConfig field Megatron's own attention and MTP read has a decision in
docs/megatron_options.md: honoured (a test that exists) or refused (a message that is in our code).

The fields come from Megatron's source, not from a list kept here: the `config.<field>` and
`self.config.<field>` reads (and `getattr(config, "<field>", ...)`) of `DotProductAttention`,
`TEDotProductAttention`, multi-latent attention (`multi_latent_attention.py`), the multi-token prediction
module and the GPT model. The installed megatron-core
is always checked; a Megatron-LM checkout too when MEGATRON_LM_DIR points at one (e.g. its main branch).
"""

import ast
import os
import re
from pathlib import Path

import megatron.core
import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "megatron_options.md"
SOURCES = (  # (file under megatron/core, the class read, or None for the whole file)
    ("transformer/dot_product_attention.py", "DotProductAttention"),
    ("extensions/transformer_engine.py", "TEDotProductAttention"),
    ("transformer/multi_token_prediction.py", None),
    ("models/gpt/gpt_model.py", None),
    ("transformer/multi_latent_attention.py", None),
)


def _is_config(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "config") or (
        isinstance(node, ast.Attribute) and node.attr == "config"
    )


def config_reads(source: str, class_name: str | None) -> set[str]:
    """Fields read from `config` / `self.config` in `source` (inside class `class_name` when given)."""
    tree = ast.parse(source)
    roots = [tree] if class_name is None else [
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name
    ]
    assert roots, f"class {class_name} not found: Megatron moved it, update SOURCES"
    fields = set()
    for root in roots:
        for node in ast.walk(root):
            if isinstance(node, ast.Attribute) and _is_config(node.value):
                fields.add(node.attr)
            elif (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                and _is_config(node.args[0]) and isinstance(node.args[1], ast.Constant)
            ):
                fields.add(node.args[1].value)
    return fields


def megatron_fields(core: Path) -> set[str]:
    return set().union(*(config_reads((core / path).read_text(), cls) for path, cls in SOURCES))


def table() -> dict[str, tuple[str, str]]:
    """field -> (decision, evidence) from the markdown table."""
    rows = {}
    for line in TABLE.read_text().splitlines():
        match = re.match(r"\| `(\w+)` \| (\w+) \| (.+) \|$", line)
        if match:
            assert match.group(1) not in rows, f"{match.group(1)} is in the table twice"
            rows[match.group(1)] = (match.group(2), match.group(3))
    return rows


def _cores() -> list:
    cores = [pytest.param(Path(megatron.core.__file__).parent, id="installed-megatron-core")]
    checkout = os.environ.get("MEGATRON_LM_DIR")
    if checkout:
        cores.append(pytest.param(Path(checkout) / "megatron" / "core", id="MEGATRON_LM_DIR"))
    return cores


def test_extraction_finds_the_reads_it_is_meant_to():
    """The AST walk sees attribute reads, self.config reads and getattr reads, and the class filter."""
    source = (
        "class A:\n    def f(self, config):\n        config.a; self.config.b; getattr(config, 'c', 0)\n"
        "class B:\n    def g(self):\n        self.config.d\n"
    )
    assert config_reads(source, "A") == {"a", "b", "c"}
    assert config_reads(source, None) == {"a", "b", "c", "d"}


@pytest.mark.parametrize("core", _cores())
def test_every_field_megatron_attention_and_mtp_read_has_a_decision(core):
    missing = sorted(megatron_fields(core) - set(table()))
    assert not missing, (
        f"TransformerConfig fields read by Megatron's attention / MTP in {core} with no decision in "
        f"{TABLE.relative_to(ROOT)}: {missing}. Honour each under --hdp (and name its test) or refuse it "
        "(megatron_hdp/megatron/layers/options.py) and add a row"
    )


def _code() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "megatron_hdp").rglob("*.py"))


def test_every_decision_has_its_evidence():
    code = _code()
    for field, (decision, evidence) in table().items():
        assert decision in ("honoured", "refused"), (field, decision)
        if decision == "honoured":
            test = re.match(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", evidence)
            assert test, f"{field}: an honoured option names its test, got {evidence!r}"
            path = ROOT / test.group(1)
            assert path.is_file(), f"{field}: {test.group(1)} does not exist"
            if test.group(2):
                assert f"def {test.group(2)}(" in path.read_text(), f"{field}: no test {test.group(2)} in {path.name}"
        else:
            quoted = re.match(r'"([^"]+)"', evidence)
            assert quoted, f"{field}: a refused option quotes its message, got {evidence!r}"
            assert quoted.group(1) in code, f"{field}: the message {quoted.group(1)!r} is not in megatron_hdp/"
