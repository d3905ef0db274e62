"""No production function over 100 lines in server/, daemon/, client/.

C++ (clang-formatted, Google style): a definition is a line ending in "{"
at column 0 or 2 (a member in a class body) whose statement has a "(";
its body runs to the "}" at the same indentation. Python: every function
and method, from `def` to its last line, by the ast module. Tests, test
doubles (testing/ folders), fuzzers and examples are not production code.

    python3 tests/function_length.py REPO_ROOT [--max N]

Prints each function over the limit (lines, file:line, name) and exits 1
when there is one.
"""

import ast
import pathlib
import re
import sys

ROOTS = ("server", "daemon", "client")
SKIP = re.compile(r"(_test\.(cc|py)$|/testing/|/fuzz/|/examples/|/tests/)")
DEF = re.compile(r"^( {0,2})(\S.*)\{$")
NOT_FUNCTION = re.compile(r"^\s*(namespace|class|struct|enum|union|extern)\b")


def cpp_functions(path: pathlib.Path):
    lines = path.read_text().split("\n")
    i = 0
    while i < len(lines):
        m = DEF.match(lines[i])
        statement = "".join(lines[max(0, i - 6) : i + 1])
        if (
            m
            and "(" in statement
            and not NOT_FUNCTION.match(lines[i])
            and not lines[i].rstrip().endswith("= {")
        ):
            indent = m.group(1)
            j = i + 1
            while j < len(lines) and not re.match(
                re.escape(indent) + r"\}($|[;) ])", lines[j]
            ):
                j += 1
            k = i
            while k > 0 and "(" not in lines[k]:
                k -= 1
            yield j - i + 1, i + 1, lines[k].strip()[:80]
            i = j
        i += 1


def python_functions(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield node.end_lineno - start + 1, node.lineno, node.name


def main(argv):
    root = pathlib.Path(argv[1])
    limit = int(argv[argv.index("--max") + 1]) if "--max" in argv else 100
    over = []
    for top in ROOTS:
        for path in sorted((root / top).rglob("*")):
            rel = str(path.relative_to(root))
            if SKIP.search("/" + rel) or not path.is_file():
                continue
            if path.suffix in (".cc", ".h", ".cu"):
                found = cpp_functions(path)
            elif path.suffix == ".py":
                found = python_functions(path)
            else:
                continue
            over += [(n, f"{rel}:{line}", name) for n, line, name in found if n > limit]
    for n, where, name in sorted(over, reverse=True):
        print(f"{n:5d} lines  {where}  {name}")
    if over:
        print(f"function_length: {len(over)} production functions over {limit} lines")
        return 1
    print(f"function_length: no production function over {limit} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
