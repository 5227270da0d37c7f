"""The code's shape, held by a test: no function in stages/ or hybridcore/ over 60 lines, and bench/ imports no
test code (tests may import bench/'s shared fixtures, never the reverse)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60


def test_no_function_over_60_lines():
    long = []
    for folder in ("stages", "hybridcore"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these: " + "; ".join(long)


def test_bench_imports_no_test_code():
    bad = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert not bad, bad
