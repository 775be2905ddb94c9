"""The import graph has no cycle, imports made inside functions included (grimp reads those too).

import-linter's contracts (pyproject.toml, run by the test command) keep each floor below the one
above it; this checks what they do not: no two modules anywhere in the tree import each other,
directly or round a loop."""

import grimp

PACKAGES = ("berth", "tenancy", "scheduler", "serving", "gateway")


def strongly_connected(graph) -> list[list[str]]:
    """Tarjan's algorithm over the graph's modules: every group of two or more that import each other."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []
    counter = [0]

    def visit(module):
        work = [(module, iter(sorted(graph.find_modules_directly_imported_by(module))))]
        index[module] = low[module] = counter[0]
        counter[0] += 1
        stack.append(module)
        on_stack.add(module)
        while work:
            current, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[current] = min(low[current], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[current])
                if low[current] == index[current]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == current:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return groups


def test_no_module_of_the_tree_is_in_an_import_cycle():
    graph = grimp.build_graph(*PACKAGES)
    assert strongly_connected(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for module in ("a", "b", "c", "d"):
        graph.add_module(module)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    graph.add_import(importer="c", imported="a")
    graph.add_import(importer="c", imported="d")
    assert strongly_connected(graph) == [["a", "b", "c"]]
