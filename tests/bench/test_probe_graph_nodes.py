"""bench/probe_graph_nodes.py reads a graph's DOT as `cudaGraphDebugDotPrint` writes it: multi-line kernel labels,
record labels for other node kinds, edges with and without attributes (an edge's attributes are not a node)."""

from __future__ import annotations

from bench.probe_graph_nodes import first_nodes

DOT = '''digraph dot {
subgraph cluster_1 {
label="graph_1" graph[style="dashed"];
"graph_1_node_0"[style="solid" shape="rectangle" label="0
_from_host_kernel
\\<\\<\\<(1,1,1),(128,1,1),0\\>\\>\\>"];

"graph_1_node_1"[style="solid" shape="record" label="{EVENT_RECORD | {ID | node handle} | {1 | 0x1}}"];

"graph_1_node_2"[style="solid" shape="rectangle" label="2
_resolve_kernel
\\<\\<\\<(1,1,1),(128,1,1),0\\>\\>\\>"];

"graph_1_node_3"[style="solid" shape="rectangle" label="3
_rms_norm_kernel
\\<\\<\\<(1,1,1),(256,1,1),0\\>\\>\\>"];

"graph_1_node_0" -> "graph_1_node_1";
"graph_1_node_0" -> "graph_1_node_2" [label="programmatic"];
"graph_1_node_2" -> "graph_1_node_3";
}
}
'''


def test_the_nodes_are_read_breadth_first_from_the_roots_with_their_edges():
    lines = first_nodes(DOT, 10)
    assert lines[0].startswith("kinds: ") and "_from_host_kernel x1" in lines[0] and "EVENT_RECORD x1" in lines[0]
    assert lines[1] == ("graph_1_node_0: _from_host_kernel -> graph_1_node_1(EVENT_RECORD), "
                        'graph_1_node_2(_resolve_kernel label="programmatic")')
    assert [line.split(":")[0] for line in lines[2:]] == ["graph_1_node_1", "graph_1_node_2", "graph_1_node_3"]
    assert len(first_nodes(DOT, 2)) == 3  # the kinds line and two nodes
