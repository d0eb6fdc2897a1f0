"""Messages and node texts name a node as users see it in the editor, by its display name ("Train LoRA: Init
(Headroom): ..."), never by its class id ("HeadroomTrainLoraInit: ...", which the editor shows nowhere) (issue 44).
Read from the source with ast, so no ComfyUI is needed: no string in nodes/ starts with a node id, except the ids
themselves in the schemas. The in-process tests (tests/comfy/test_node_names.py) check the messages the nodes give."""
import ast
import json
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
NODE_IDS = sorted(json.loads((REPO / "tests" / "node_schemas.json").read_text()), key=len, reverse=True)
STARTS_WITH_AN_ID = re.compile(r"(?:%s)\b" % "|".join(NODE_IDS))


def strings_starting_with_a_node_id(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant (a plain string, or the literal start of an f-string) that starts
    with a node id, other than a schema's `node_id=`."""
    tree = ast.parse(source)
    schema_ids = {id(keyword.value) for keyword in ast.walk(tree)
                  if isinstance(keyword, ast.keyword) and keyword.arg == "node_id"}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in schema_ids
            and STARTS_WITH_AN_ID.match(node.value)]


def test_no_message_starts_with_a_node_id():
    assert "HeadroomTrainLoraInit" in NODE_IDS and "HeadroomTrainLora" in NODE_IDS
    found = [f"{path.relative_to(REPO)}:{line}: {text[:80]!r}" for path in sorted((REPO / "nodes").rglob("*.py"))
             for line, text in strings_starting_with_a_node_id(path.read_text())]
    assert found == [], "messages naming a node by its class id; use its display name (node_name):\n" + "\n".join(found)


def test_the_check_finds_what_it_looks_for():
    source = '''
class HeadroomSaveLora:
    """HeadroomSaveLora: a docstring is a string too."""
    def define_schema(cls):
        return io.Schema(node_id="HeadroomSaveLora", display_name="Save LoRA (Headroom)")
    def execute(cls, run, node="HeadroomTrainLoraInit"):
        raise ValueError(f"HeadroomSaveLora: {run} is no run")
'''
    assert [line for line, _ in strings_starting_with_a_node_id(source)] == [3, 6, 7]
    assert strings_starting_with_a_node_id('x = f"{node}: Save LoRA (Headroom) {y}"') == []
