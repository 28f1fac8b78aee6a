"""bench/probe_graph_nodes.py reads a graph's DOT as `cuGraphDebugDotPrint` writes it: record labels that open with
the node's type, a kernel's function name in its ID row (mangled or not), edges with their `headlabel` (an edge's
attributes are not a node)."""

from __future__ import annotations

from bench.probe_graph_nodes import demangle, first_nodes

DOT = r'''digraph dot {
subgraph cluster_1 {
label="graph_1" graph[style="dashed"];
"graph_1_node_0"[style="bold" shape="record" label="{KERNEL
| {ID | 0 (topoId: 3) | _from_host_kernel\<\<\<1,128,0\>\>\>}
| {{node handle | func handle} | {0x00005 | 0x00006}}
| {cooperative | 0}
| {priority | 0}
}"];
"graph_1_node_1"[style="solid" shape="record" label="{
EVENT_RECORD
| {{ID | node handle} | {1 (topoId: 2) | 0x00007}}
}"];
"graph_1_node_2"[style="bold" shape="record" label="{KERNEL
| {ID | 2 (topoId: 1) | _ZN2at6native29vectorized_elementwise_kernelILi4EEEviT0_\<\<\<1,128,0\>\>\>}
| {cooperative | 0}
}"];
"graph_1_node_3"[style="solid" shape="record" label="{
MEMSET
| {{ID | node handle | dptr | value | width} | {3 (topoId: 0) | 0x00008 | 0x7f00 | 0 | 64}}
}"];
"graph_1_node_0" -> "graph_1_node_1" [headlabel=0];
"graph_1_node_0" -> "graph_1_node_2" [headlabel=1];
"graph_1_node_2" -> "graph_1_node_3" [headlabel=0];
}
}
'''


def test_the_nodes_are_read_breadth_first_from_the_roots_with_their_edges():
    lines = first_nodes(DOT, 10)
    assert lines[0] == ("kinds: _from_host_kernel x1, EVENT_RECORD x1, at::native::vectorized_elementwise_kernel x1, "
                        "MEMSET x1")
    assert lines[1] == "edges: headlabel=0 x2, headlabel=1 x1"
    assert lines[2] == ("graph_1_node_0: _from_host_kernel -> graph_1_node_1(EVENT_RECORD headlabel=0), "
                        "graph_1_node_2(at::native::vectorized_e headlabel=1)")
    assert [line.split(":")[0] for line in lines[3:]] == ["graph_1_node_1", "graph_1_node_2", "graph_1_node_3"]
    assert len(first_nodes(DOT, 2)) == 4  # the kinds and edges lines and two nodes


def test_a_mangled_name_reads_as_its_nested_name():
    assert demangle("_Z6kernelPf") == "kernel"
    assert demangle("_ZN2at6native29vectorized_elementwise_kernelILi4E") == "at::native::vectorized_elementwise_kernel"
    assert demangle("_fused_kernel") == "_fused_kernel"
