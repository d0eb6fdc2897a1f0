"""locales/en/nodeDefs.json against the node schemas, the source of truth: the editor's English strings for every
node Headroom registers (display name, description, input and output names and tooltips) are exactly what
workflows/build_locales.py builds from the schemas, so they never drift from the code. The editor itself reading
them: tests/browser/test_locales_in_editor.py."""
from __future__ import annotations

import json

from headroom.workflows import build_locales


def test_english_node_strings_are_the_schemas(headroom_nodes):
    wanted = build_locales.node_defs(build_locales.node_infos(build_locales.pack_nodes(headroom_nodes)))
    path = build_locales.NODE_DEFS_FILE
    assert path.is_file(), f"no {path.name}: run `{build_locales.BUILD_COMMAND}` and commit locales/"
    changes = build_locales.differences(json.loads(path.read_text(encoding="utf-8")), wanted)
    assert not changes, (f"{len(changes)} string(s) of locales/en/{path.name} differ from the node schemas (file -> "
                         f"schema); run `{build_locales.BUILD_COMMAND}` and commit it:\n  " + "\n  ".join(changes[:40]))
    assert path.read_text(encoding="utf-8") == build_locales.dumps(wanted), \
        f"locales/en/{path.name} was edited by hand (same strings, other layout): run `{build_locales.BUILD_COMMAND}`"
