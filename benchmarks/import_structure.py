"""The import structure of services/, for this tree and a baseline commit side by side: modules, arrows between
them, import circles, depth (floors), which modules import Ray, and the largest files.

    python -m benchmarks.import_structure [--baseline REV] [--out benchmarks/results/import_structure.json]

An arrow is an import that runs (`if TYPE_CHECKING:` imports are annotations and do not count; function-level
imports do). A circle is a strongly connected set of more than one module. Floors: the longest chain of
arrows from a services/ module down to the libraries, counted in the graph with each circle merged into one node.
The rules the current layout keeps are tests (tests/test_architecture.py); this measures, it does not judge.
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("rollout", "reward", "trainer", "services")


def _module(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph(root: Path) -> tuple[dict[str, set[str]], set[str], dict[str, int]]:
    """(module -> the steadyrl modules it imports, the modules that import Ray, module -> lines)."""
    paths = {_module(root, p): p for part in PARTS for p in sorted((root / part).rglob("*.py"))}
    graph, ray, lines = {}, set(), {}
    for name, path in paths.items():
        text = path.read_text()
        tree, lines[name] = ast.parse(text), len(text.splitlines())
        skip, out = _type_checking_lines(tree), set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target == "ray" or target.startswith("ray."):
                    ray.add(name)
                local = target.removeprefix("steadyrl.")
                if target.startswith("steadyrl.") and local in paths and local != name:
                    out.add(local)
        graph[name] = out
    return graph, ray, lines


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


def floors(graph: dict[str, set[str]], merged: list[list[str]]) -> int:
    """The longest chain from a services/ module to a library module, with each circle one node."""
    node_of = {m: m for m in graph} | {m: members[0] for members in merged for m in members}
    dag: dict[str, set[str]] = {}
    for src, dsts in graph.items():
        dag.setdefault(node_of[src], set()).update(node_of[d] for d in dsts if node_of[d] != node_of[src])
    depth: dict[str, int] = {}

    def height(node: str) -> int:  # the DAG is acyclic: plain recursion terminates
        if node not in depth:
            below = [height(d) for d in dag.get(node, ())]
            depth[node] = int(node.startswith("services")) + max(below, default=0)
        return depth[node]

    return max(height(node_of[m]) for m in graph if m.startswith("services"))


def measure(root: Path) -> dict[str, Any]:
    graph, ray, lines = import_graph(root)
    services = sorted(m for m in graph if m.startswith("services"))
    found = circles(graph)
    return {"services_modules": len(services),
            "services_arrows": sum(len(graph[m]) for m in services),
            "floors": floors(graph, found),
            "circles": found,
            "ray_importers": sorted(ray),
            "largest_files": [{"module": m, "lines": lines[m]}
                              for m in sorted(services, key=lambda m: -lines[m])[:6]]}


def _checkout(rev: str, into: Path) -> Path:
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *PARTS], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="a git revision to measure beside this tree")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/import_structure.json")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"this_tree": measure(ROOT)}
    if args.baseline:
        with tempfile.TemporaryDirectory() as tmp:
            result["baseline"] = {"rev": args.baseline, **measure(_checkout(args.baseline, Path(tmp)))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, m in result.items():
        print(f"{name}: {m['services_modules']} services/ modules, {m['services_arrows']} arrows, {m['floors']} "
              f"floors, circles {[len(c) for c in m['circles']]}, {len(m['ray_importers'])} Ray importers; largest "
              + ", ".join(f"{f['module']} ({f['lines']})" for f in m["largest_files"][:3]))
    return result


if __name__ == "__main__":
    main()
