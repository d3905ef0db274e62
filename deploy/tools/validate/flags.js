#!/usr/bin/env node
// Checks that the command lines the chart and the Dockerfile give dmuond and
// dmuonctl parse, and that what the Dockerfile copies and builds exists.
//
//   node flags.js --root REPO [--dockerfile FILE] [--dmuond BIN] [--dmuonctl BIN] RENDERED...
//
// Command lines come from the rendered manifests (the dmuond container's
// args, in DaemonSets and in sidecar snippets; exec probes that run
// dmuonctl) and from the Dockerfile (ENTRYPOINT/CMD, HEALTHCHECK). Every
// --flag of each must be one the binary's `--help` lists (and dmuonctl's
// command one its help names). Values are not checked here (the chart's
// schema and checks constrain them). Without a binary that check is reported
// as skipped.
//
// Prints one line per check ("ok", "FAIL", "skip"), then a summary line;
// exit status 1 when a check failed.

import fs from "node:fs";
import path from "node:path";
import { spawnSync } from "node:child_process";
import yaml from "js-yaml";

const args = process.argv.slice(2);
const opt = { rendered: [] };
for (let i = 0; i < args.length; i++) {
  const a = args[i];
  if (["--root", "--dockerfile", "--dmuond", "--dmuonctl"].includes(a)) opt[a.slice(2)] = args[++i];
  else opt.rendered.push(a);
}
const results = { ok: 0, fail: 0, skip: 0 };
const say = (kind, msg) => {
  results[kind]++;
  console.log(`${kind === "fail" ? "FAIL" : kind} ${msg}`);
};

// program -> Map(key -> {args, from: Set})
const lines = { dmuond: new Map(), dmuonctl: new Map() };
function addLine(program, argv, from) {
  const key = JSON.stringify(argv);
  if (!lines[program].has(key)) lines[program].set(key, { argv, from: new Set() });
  lines[program].get(key).from.add(from);
}

function podSpecs(obj) {
  const out = [];
  const t = obj && obj.spec && obj.spec.template;
  if (t && t.spec) out.push(t.spec);
  if (obj && obj.kind === "Pod") out.push(obj.spec || {});
  if (obj && obj.kind === "ConfigMap" && ((obj.metadata || {}).labels || {})["dmuon.io/snippet"] === "sidecar") {
    const s = (obj.data || {})["pod-spec.yaml"];
    if (s) out.push(yaml.load(s));
  }
  return out;
}

for (const file of opt.rendered) {
  const label = path.basename(file);
  for (const obj of yaml.loadAll(fs.readFileSync(file, "utf8"))) {
    for (const spec of podSpecs(obj)) {
      for (const c of [...(spec.initContainers || []), ...(spec.containers || [])]) {
        if (c.name === "dmuond") {
          if (c.command) addLine("dmuond", c.command.slice(1), label);
          addLine("dmuond", c.args || [], label);
        }
        for (const p of ["startupProbe", "readinessProbe", "livenessProbe"]) {
          const cmd = c[p] && c[p].exec && c[p].exec.command;
          if (cmd && cmd[0] === "dmuonctl") addLine("dmuonctl", cmd.slice(1), label);
        }
      }
    }
  }
}

// ------------------------------------------------------------ Dockerfile

function dockerInstructions(text) {
  // Join continuation lines, drop comments.
  const out = [];
  let cur = "";
  for (const raw of text.split("\n")) {
    const line = raw.replace(/\s+$/, "");
    if (!cur && /^\s*#/.test(line)) continue;
    if (line.endsWith("\\")) {
      cur += line.slice(0, -1) + " ";
      continue;
    }
    cur += line;
    if (cur.trim()) out.push(cur.trim());
    cur = "";
  }
  return out;
}

if (opt.dockerfile) {
  const df = opt.dockerfile;
  const text = fs.readFileSync(df, "utf8");
  const ins = dockerInstructions(text);
  let entrypoint = null;
  let cmd = null;
  const problems = [];
  for (const i of ins) {
    const m = /^(\w+)\s+(.*)$/s.exec(i);
    if (!m) continue;
    const [, word, rest] = m;
    const op = word.toUpperCase();
    if (op === "ENTRYPOINT" || op === "CMD") {
      let v;
      try {
        v = JSON.parse(rest);
      } catch {
        problems.push(`${op} must use the exec (JSON array) form: ${rest}`);
        continue;
      }
      if (op === "ENTRYPOINT") entrypoint = v;
      else cmd = v;
    } else if (op === "HEALTHCHECK") {
      const hm = /\bCMD\s+(\[.*\])\s*$/.exec(rest);
      if (!hm) problems.push(`HEALTHCHECK must use CMD ["dmuonctl", ...]: ${rest}`);
      else {
        const v = JSON.parse(hm[1]);
        if (v[0] !== "dmuonctl") problems.push(`HEALTHCHECK runs ${v[0]}, expected dmuonctl`);
        addLine("dmuonctl", v.slice(1), "Dockerfile HEALTHCHECK");
      }
    } else if (op === "COPY" || op === "ADD") {
      const parts = rest.split(/\s+/);
      if (parts.some((p) => p.startsWith("--from"))) continue;
      const srcs = parts.filter((p) => !p.startsWith("--")).slice(0, -1);
      for (const s of srcs) {
        if (/[*?$]/.test(s)) continue;
        if (!fs.existsSync(path.join(opt.root, s))) problems.push(`${op} source ${s} does not exist in the build context (repository root)`);
      }
    }
  }
  if (!entrypoint || entrypoint[0] !== "dmuond") problems.push(`ENTRYPOINT must be ["dmuond"], got ${JSON.stringify(entrypoint)}`);
  else addLine("dmuond", [...entrypoint.slice(1), ...(cmd || [])], "Dockerfile ENTRYPOINT+CMD");
  // Bazel labels the Dockerfile builds must exist.
  for (const [, pkg, name] of text.matchAll(/\/\/([A-Za-z0-9_/.-]*):([A-Za-z0-9_.-]+)/g)) {
    const build = ["BUILD", "BUILD.bazel"].map((b) => path.join(opt.root, pkg, b)).find((p) => fs.existsSync(p));
    if (!build) problems.push(`Bazel package //${pkg} has no BUILD file`);
    else if (!new RegExp(`name\\s*=\\s*"${name.replace(/[.]/g, "\\.")}"`).test(fs.readFileSync(build, "utf8")))
      problems.push(`Bazel target //${pkg}:${name} is not defined in ${path.relative(opt.root, build)}`);
  }
  if (problems.length) {
    say("fail", `${path.relative(opt.root, df)}: ${problems.length} problem(s)`);
    for (const p of problems) console.log(`  ${p}`);
  } else {
    say("ok", `${path.relative(opt.root, df)}: COPY sources and Bazel targets exist, ENTRYPOINT/CMD/HEALTHCHECK in exec form`);
  }
}

// ------------------------------------------------------------ run the binaries

// The flags (and, for dmuonctl, the commands) a binary's --help lists.
function helpOf(bin) {
  const r = spawnSync(bin, ["--help"], { encoding: "utf8", timeout: 20000 });
  if (r.error) return { error: r.error.message };
  const text = `${r.stdout || ""}\n${r.stderr || ""}`;
  const flags = new Set();
  for (const m of text.matchAll(/^\s*--([A-Za-z0-9][A-Za-z0-9_-]*)/gm)) flags.add(m[1]);
  return { text, flags };
}

for (const program of ["dmuond", "dmuonctl"]) {
  const bin = opt[program];
  const all = [...lines[program].values()];
  if (!all.length) continue;
  if (!bin || !fs.existsSync(bin)) {
    say("skip", `${program}: ${all.length} command line(s) not checked (no binary${bin ? ` at ${bin}` : ""}; build //server:${program})`);
    continue;
  }
  const help = helpOf(bin);
  if (help.error || !help.flags.size) {
    say("fail", `${program} --help lists no flags${help.error ? `: ${help.error}` : ""}`);
    continue;
  }
  for (const { argv, from } of all) {
    const problems = [];
    for (const a of argv) {
      if (a.startsWith("--")) {
        const name = a.slice(2).split("=")[0];
        if (!help.flags.has(name)) problems.push(`unknown flag --${name}`);
      } else if (program === "dmuonctl" && !new RegExp(`\\b${a}\\b`).test(help.text)) {
        problems.push(`unknown command ${a}`);
      }
    }
    const where = [...from].join(", ");
    if (problems.length) {
      say("fail", `${program} does not know what ${where} passes it: ${problems.join(", ")}`);
      console.log(`  ${program} ${argv.join(" ")}`);
    } else say("ok", `${program} knows every flag ${where} passes it (${argv.filter((a) => a.startsWith("--")).length})`);
  }
}

console.log(`flags: ${results.ok} ok, ${results.fail} failed, ${results.skip} skipped`);
process.exit(results.fail ? 1 : 0);
