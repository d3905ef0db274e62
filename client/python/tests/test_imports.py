"""The dmuon package's shape: every module imports alone, in a fresh
interpreter, and no module imports another that (directly or not) imports
it back, whether the import is at module level or inside a function (a
function-local import would only hide such a cycle; imports under
`if TYPE_CHECKING:` never run and are left out); no function is over 100
lines, and no class is a mixin."""

import ast
import json
import pathlib
import subprocess
import sys

import dmuon

PACKAGE = pathlib.Path(dmuon.__file__).parent
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py"))


def _name(stem):
    return "dmuon" if stem == "__init__" else f"dmuon.{stem}"


def _type_checking_only(node):
    test = node.test
    return (isinstance(node, ast.If)
            and (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
                 or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree):
    """The Import/ImportFrom nodes of a module, at any depth, except those
    under `if TYPE_CHECKING:`."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                todo.extend(child.orelse)
                continue
            todo.append(child)
    return out


def _edges(stem):
    """The package modules `stem` imports."""
    known = {_name(s) for s in MODULES}
    tree = ast.parse((PACKAGE / f"{stem}.py").read_text())
    here = "dmuon"  # every module of the package is directly in it
    out = set()
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
            continue
        base = node.module or ""
        if node.level:
            base = here + (f".{base}" if base else "")
        if base not in known:
            continue
        for a in node.names:  # `from . import _x` imports the module dmuon._x
            sub = f"{base}.{a.name}"
            out.add(sub if sub in known else base)
    out.discard(_name(stem))
    return out


def _cycle(graph):
    """One import cycle of `graph` as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    graph = {_name(s): _edges(s) for s in MODULES}
    # The checker sees the cycles it must see.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert graph["dmuon.optim"]  # it read the imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_routing_is_at_the_bottom():
    """_routing imports nothing of the package; _parts and _dtensor import
    it and not each other."""
    assert _edges("_routing") == set()
    assert "dmuon._routing" in _edges("_parts") and "dmuon._routing" in _edges("_dtensor")
    assert "dmuon._dtensor" not in _edges("_parts")
    assert "dmuon._parts" not in _edges("_dtensor")


# Imports each module given in a child forked from an interpreter that has
# imported torch and nothing of dmuon (torch once, not once per module):
# prints {module: the error's last line} of those that failed.
_ALONE = """
import importlib, json, os, sys, traceback, warnings
import torch
failed = {}
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            with warnings.catch_warnings():
                # dmuon.torch, the deprecated alias of dmuon.optim, warns.
                warnings.simplefilter("ignore" if name == "dmuon.torch" else "error")
                importlib.import_module(name)
        except BaseException:
            os.write(w, traceback.format_exc().strip().splitlines()[-1].encode())
            os._exit(1)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        why = f.read()
    if os.waitpid(pid, 0)[1] != 0:
        failed[name] = why or "the child died"
print(json.dumps(failed))
"""


def test_every_module_imports_alone_in_a_fresh_interpreter():
    names = [_name(s) for s in MODULES]
    out = subprocess.run([sys.executable, "-c", _ALONE, *names], capture_output=True,
                         text=True, timeout=150, cwd=str(PACKAGE.parent))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_no_function_of_the_package_is_over_100_lines():
    long = []
    for stem in MODULES:
        tree = ast.parse((PACKAGE / f"{stem}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 100:
                    long.append(f"{stem}.{node.name}: {n} lines")
    assert long == []


def test_the_package_has_no_mixin():
    """Classes own their state; none is a base class another module's class
    borrows attributes through (DMuon's only base is torch.optim.Optimizer)."""
    mixins = []
    for stem in MODULES:
        tree = ast.parse((PACKAGE / f"{stem}.py").read_text())
        mixins += [f"{stem}.{n.name}" for n in ast.walk(tree)
                   if isinstance(n, ast.ClassDef) and "mixin" in n.name.lower()]
    assert mixins == []
    from dmuon.optim import DMuon
    assert [c.__name__ for c in DMuon.__mro__] == ["DMuon", "Optimizer", "object"]


def _python(code):
    """What a fresh interpreter running `code` printed (it must exit 0)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=str(PACKAGE.parent), timeout=60, check=True).stdout


def test_without_torch_the_error_names_the_extra():
    """Issue 29, item 11: without PyTorch, `import dmuon` works (orthogonalize,
    Client) and `import dmuon.optim` names the extra that installs it, not a
    bare "No module named 'torch'"."""
    out = _python("import sys; sys.modules['torch'] = None\n"
                  "import dmuon\n"
                  "try:\n"
                  "    import dmuon.optim\n"
                  "except ModuleNotFoundError as e:\n"
                  "    print('ERR', e.name, e)\n")
    assert out.startswith("ERR torch dmuon.optim needs PyTorch"), out
    assert "pip install 'dmuon[torch]'" in out, out


def test_torchtitan_is_imported_only_by_its_integration():
    """Issue 29, torchtitan: dmuon, dmuon.optim and dmuon.integrations never
    import torchtitan; without it, dmuon.integrations.torchtitan names the
    pip install that brings it."""
    out = _python("import sys\n"
                  "import dmuon, dmuon.optim, dmuon.integrations\n"
                  "print('IMPORTED', 'torchtitan' in sys.modules)\n"
                  "sys.modules['torchtitan'] = None\n"
                  "try:\n"
                  "    import dmuon.integrations.torchtitan\n"
                  "except ImportError as e:\n"
                  "    print('ERR', e.name, e)\n")
    assert out.startswith("IMPORTED False\nERR torchtitan "), out
    assert "pip install torchtitan==0.3.0" in out, out
