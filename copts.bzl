"""Compiler flags every dmuon C++ target uses: warnings are errors."""

DMUON_COPTS = [
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unused-parameter",
]
