"""Generates C++ protobuf + gRPC sources with Debian's protoc and plugin."""

def dmuon_grpc_sources(name, src):
    """`name`: a genrule producing <stem>.pb.{cc,h} and <stem>.grpc.pb.{cc,h}."""
    stem = src[:-len(".proto")]
    native.genrule(
        name = name,
        srcs = [src],
        outs = [
            stem + ".pb.cc",
            stem + ".pb.h",
            stem + ".grpc.pb.cc",
            stem + ".grpc.pb.h",
        ],
        cmd = "protoc --proto_path=. --cpp_out=$(GENDIR) " +
              "--grpc_out=$(GENDIR) --plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin " +
              "$(location " + src + ")",
    )
