"""dmuon_fuzz_test: a libFuzzer harness that is also a plain test.

Without --config=fuzz the harness links tools/fuzz/replay_main.cc and the
test replays the seed corpus once (a regression test in every build). With
--config=fuzz (clang-14, ASan+UBSan, libFuzzer) it links libFuzzer and the
test fuzzes for DMUON_FUZZ_SECONDS from the seeds.
"""

load("@rules_cc//cc:defs.bzl", "cc_binary")
load("//:copts.bzl", "DMUON_COPTS")

def dmuon_fuzz_test(name, srcs, corpus, deps = [], size = "medium", tags = []):
    """A harness `name`_harness and the sh_test `name` running it.

    Args:
      name: the test.
      srcs: sources defining LLVMFuzzerTestOneInput.
      corpus: the seed corpus files (one directory).
      deps: the harness's libraries.
      size: the test's size.
      tags: extra tags.
    """
    cc_binary(
        name = name + "_harness",
        testonly = True,
        srcs = srcs,
        copts = DMUON_COPTS,
        linkopts = select({
            "//tools/fuzz:libfuzzer": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
        deps = deps + select({
            "//tools/fuzz:libfuzzer": [],
            "//conditions:default": ["//tools/fuzz:replay_main"],
        }),
    )
    native.sh_test(
        name = name,
        size = size,
        srcs = ["//tools/fuzz:run_fuzzer.sh"],
        args = [
            "$(location :%s_harness)" % name,
            # One seed; the script runs the whole directory it is in.
            "$(location %s)" % corpus[0],
        ],
        data = [":" + name + "_harness"] + corpus,
        tags = tags + ["fuzz"],
    )
