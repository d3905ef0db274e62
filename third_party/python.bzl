"""The CPython headers of the project's Python, as @python//:headers.

The Python extension must be built for the interpreter that loads it: the
project's .venv/bin/python (made by `./dmuon setup` from Debian's
/usr/bin/python3), or $DMUON_PYTHON. The headers are found by asking that
interpreter (sysconfig), never by a hard-coded path.
"""

def _python_headers_impl(ctx):
    python = ctx.os.environ.get("DMUON_PYTHON", "")
    if not python:
        venv = ctx.path(Label("//:WORKSPACE")).dirname.get_child(".venv")
        python = str(venv) + "/bin/python"
        if not ctx.path(python).exists:
            python = "/usr/bin/python3"
    res = ctx.execute([python, "-c", "import sys, sysconfig; " +
                                     "print(sysconfig.get_paths()['include']); " +
                                     "print('%d.%d' % sys.version_info[:2])"])
    if res.return_code != 0:
        fail("cannot ask %s for its headers (run ./dmuon setup, or set DMUON_PYTHON): %s" %
             (python, res.stderr))
    include, version = res.stdout.strip().split("\n")
    if not ctx.path(include + "/Python.h").exists:
        fail("%s has no Python.h in %s: install python%s-dev" % (python, include, version))
    ctx.symlink(include, "include")
    ctx.file("BUILD", """
# CPython {version} headers of {python}
cc_library(
    name = "headers",
    hdrs = glob(["include/**/*.h"]),
    includes = ["include"],
    visibility = ["//visibility:public"],
)
""".format(version = version, python = python))

python_headers = repository_rule(
    implementation = _python_headers_impl,
    environ = ["DMUON_PYTHON"],
    local = True,
)
