#!/usr/bin/env node
// Offline validation of rendered Kubernetes manifests.
//
//   node validate.js [--compare-sidecar RENDERED EXAMPLE] FILE...
//
// Each FILE is a multi-document YAML. Every object is checked:
//  1. against its Kubernetes (or Prometheus-operator) OpenAPI schema, with the
//     validators the npm packages kubernetes-models and
//     @kubernetes-models/prometheus-operator ship (types, formats, enums,
//     required fields); an apiVersion/kind with no schema is an error;
//  2. for fields the schema does not know (typos, fields at the wrong level),
//     like `kubectl apply --validate=strict`: every key of every object the
//     validator walks must be one it looked up;
//  3. by cross-object and API-server rules the schemas do not encode: names
//     and labels, unique container/port/volume names, mounts that name a
//     volume, named probe ports that exist, probes only on restartable init
//     containers (native sidecars), extended resources as integer limits,
//     Service/ServiceMonitor/PodMonitor/PodDisruptionBudget selectors and
//     port names that match something in the same file.
// ConfigMaps labelled dmuon.io/snippet=sidecar carry pod-spec.yaml and
// job-patch.yaml: both are expanded into a Pod and a Job and checked the same
// way. --compare-sidecar checks that the dmuond init container of the
// EXAMPLE Job equals the one of the snippet in RENDERED (image aside).
//
// Exit status 0 when every object passes; 1 otherwise.

import fs from "node:fs";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import yaml from "js-yaml";

const here = path.dirname(fileURLToPath(import.meta.url));
const modules = path.join(here, "node_modules");

// ------------------------------------------------------------------ schemas

const packages = [
  { pkg: "kubernetes-models", groups: null },
  { pkg: "@kubernetes-models/prometheus-operator", groups: ["monitoring.coreos.com"] },
];
const validatorCache = new Map();

async function validatorFor(apiVersion, kind) {
  const key = `${apiVersion}/${kind}`;
  if (validatorCache.has(key)) return validatorCache.get(key);
  let found = null;
  if (typeof apiVersion === "string" && typeof kind === "string" && /^[A-Za-z0-9]+$/.test(kind)) {
    const group = apiVersion.includes("/") ? apiVersion.split("/")[0] : "";
    for (const { pkg, groups } of packages) {
      if (groups && !groups.includes(group)) continue;
      if (!groups && group.endsWith("coreos.com")) continue;
      const modelFile = path.join(modules, pkg, apiVersion, `${kind}.js`);
      if (!fs.existsSync(modelFile)) continue;
      const m = /_schemas\/([A-Za-z0-9]+)\.js/.exec(fs.readFileSync(modelFile, "utf8"));
      if (!m) continue;
      const mod = await import(pathToFileURL(path.join(modules, pkg, "_schemas", `${m[1]}.js`)).href);
      found = { validate: mod.validate, schema: m[1] };
      break;
    }
  }
  validatorCache.set(key, found);
  return found;
}

// Wrap an object tree so that we learn which keys the validator looked at.
function track(value, where, registry) {
  if (value === null || typeof value !== "object") return value;
  const rec = { where, value, accessed: new Set(), iterated: false };
  registry.push(rec);
  const children = new Map();
  return new Proxy(value, {
    get(target, key, receiver) {
      const v = Reflect.get(target, key, receiver);
      if (typeof key !== "string") return v;
      rec.accessed.add(key);
      if (v === null || typeof v !== "object" || !Object.prototype.hasOwnProperty.call(target, key)) return v;
      if (!children.has(key)) {
        const sub = Array.isArray(target) ? `${where}[${key}]` : `${where}.${key}`;
        children.set(key, track(v, sub, registry));
      }
      return children.get(key);
    },
    has(target, key) {
      if (typeof key === "string") rec.accessed.add(key);
      return Reflect.has(target, key);
    },
    ownKeys(target) {
      rec.iterated = true;
      return Reflect.ownKeys(target);
    },
  });
}

function formatAjvError(e) {
  const where = e.instancePath
    ? e.instancePath.split("/").slice(1).map((seg) => seg.replace(/~1/g, "/").replace(/~0/g, "~"))
        .reduce((acc, seg) => (/^[0-9]+$/.test(seg) ? `${acc}[${seg}]` : acc ? `${acc}.${seg}` : seg), "")
    : "(object)";
  let msg = e.message;
  if (!msg) {
    const p = e.params || {};
    switch (e.keyword) {
      case "type": msg = `must be ${p.type}`; break;
      case "required": msg = `must have required property '${p.missingProperty}'`; break;
      case "enum": msg = `must be one of ${JSON.stringify(p.allowedValues)}`; break;
      case "format": msg = `must match format "${p.format}"`; break;
      case "oneOf": msg = "must match exactly one schema in oneOf"; break;
      default: msg = `${e.keyword} ${JSON.stringify(p)}`;
    }
  }
  return `${where}: ${msg}`;
}

async function schemaCheck(obj, errors) {
  const v = await validatorFor(obj.apiVersion, obj.kind);
  if (!v) {
    errors.push(`no schema for apiVersion ${obj.apiVersion} kind ${obj.kind}`);
    return;
  }
  const registry = [];
  const ok = v.validate(track(obj, "", registry));
  if (!ok) {
    // oneOf failures repeat their branches' errors: keep the readable ones.
    const seen = new Set();
    for (const e of v.validate.errors || []) {
      const s = formatAjvError(e);
      if (!seen.has(s)) errors.push(s), seen.add(s);
    }
  }
  for (const rec of registry) {
    if (Array.isArray(rec.value) || rec.iterated) continue;
    for (const k of Object.keys(rec.value)) {
      if (!rec.accessed.has(k)) errors.push(`${(rec.where + "." + k).replace(/^\./, "")}: unknown field`);
    }
  }
}

// ------------------------------------------------------------------ API rules

const DNS1123_LABEL = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;
const DNS1123_SUBDOMAIN = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$/;
const LABEL_VALUE = /^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$/;
const LABEL_NAME = /^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$/;
const IANA_SVC_NAME = /^(?=.*[a-z])[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;
const NAMESPACED_FREE = new Set(["Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "StorageClass"]);

function checkLabels(labels, where, errors) {
  for (const [k, v] of Object.entries(labels || {})) {
    const parts = k.split("/");
    const name = parts.pop();
    const prefix = parts.join("/");
    if (parts.length > 1 || (prefix && (!DNS1123_SUBDOMAIN.test(prefix) || prefix.length > 253)))
      errors.push(`${where}: label key ${JSON.stringify(k)} has an invalid prefix`);
    if (!LABEL_NAME.test(name) || name.length > 63) errors.push(`${where}: label key ${JSON.stringify(k)} is invalid`);
    if (typeof v !== "string") errors.push(`${where}: label ${k} must be a string, got ${typeof v}`);
    else if (!LABEL_VALUE.test(v) || v.length > 63) errors.push(`${where}: label ${k}=${JSON.stringify(v)} is not a valid label value`);
  }
}

function checkMetadata(obj, errors) {
  const md = obj.metadata || {};
  if (!md.name) errors.push("metadata.name: required");
  else if (!DNS1123_SUBDOMAIN.test(md.name) || md.name.length > 253)
    errors.push(`metadata.name ${JSON.stringify(md.name)}: not a DNS-1123 subdomain`);
  if (["Service"].includes(obj.kind) && md.name && (!DNS1123_LABEL.test(md.name) || md.name.length > 63))
    errors.push(`metadata.name ${JSON.stringify(md.name)}: a Service name must be a DNS-1123 label (<= 63)`);
  if (md.namespace !== undefined && !NAMESPACED_FREE.has(obj.kind) && !DNS1123_LABEL.test(md.namespace))
    errors.push(`metadata.namespace ${JSON.stringify(md.namespace)}: not a DNS-1123 label`);
  checkLabels(md.labels, "metadata.labels", errors);
}

// Returns the pod spec and its labels for workloads, else null.
function podOf(obj) {
  if (obj.kind === "Pod") return { spec: obj.spec || {}, labels: (obj.metadata || {}).labels || {}, where: "spec" };
  const t = obj.spec && obj.spec.template;
  if (t && ["DaemonSet", "Deployment", "StatefulSet", "ReplicaSet", "Job"].includes(obj.kind))
    return { spec: t.spec || {}, labels: (t.metadata || {}).labels || {}, where: "spec.template.spec" };
  if (obj.kind === "CronJob" && obj.spec && obj.spec.jobTemplate) {
    const jt = obj.spec.jobTemplate.spec.template;
    return { spec: jt.spec || {}, labels: (jt.metadata || {}).labels || {}, where: "spec.jobTemplate.spec.template.spec" };
  }
  return null;
}

function checkPod(obj, errors) {
  const pod = podOf(obj);
  if (!pod) return;
  const { spec, where } = pod;
  if (obj.kind !== "Pod") checkLabels(pod.labels, where.replace(/\.spec$/, ".metadata.labels"), errors);
  const volumes = new Set();
  for (const v of spec.volumes || []) {
    if (volumes.has(v.name)) errors.push(`${where}.volumes: duplicate volume ${v.name}`);
    volumes.add(v.name);
    if (!DNS1123_LABEL.test(v.name || "")) errors.push(`${where}.volumes: ${JSON.stringify(v.name)} is not a DNS-1123 label`);
    const sources = Object.keys(v).filter((k) => k !== "name");
    if (sources.length !== 1) errors.push(`${where}.volumes.${v.name}: needs exactly one volume source, has ${sources.length}`);
  }
  const names = new Set();
  const portNames = new Set();
  const groups = [
    ["initContainers", spec.initContainers || []],
    ["containers", spec.containers || []],
  ];
  if (!(spec.containers || []).length) errors.push(`${where}.containers: at least one container is required`);
  for (const [field, list] of groups) {
    list.forEach((c, i) => {
      const at = `${where}.${field}[${i}](${c.name})`;
      if (names.has(c.name)) errors.push(`${at}: duplicate container name`);
      names.add(c.name);
      if (!DNS1123_LABEL.test(c.name || "")) errors.push(`${at}: name is not a DNS-1123 label`);
      if (!c.image) errors.push(`${at}: image is required`);
      const own = new Set();
      for (const p of c.ports || []) {
        if (p.name !== undefined) {
          if (!IANA_SVC_NAME.test(p.name) || p.name.length > 15)
            errors.push(`${at}.ports: ${JSON.stringify(p.name)} is not a valid port name (IANA_SVC_NAME, <= 15 chars)`);
          if (portNames.has(p.name)) errors.push(`${at}.ports: duplicate port name ${p.name} in the pod`);
          portNames.add(p.name);
          own.add(p.name);
        }
        if (!(p.containerPort >= 1 && p.containerPort <= 65535)) errors.push(`${at}.ports: containerPort ${p.containerPort} out of range`);
        if (p.hostPort !== undefined && !(p.hostPort >= 1 && p.hostPort <= 65535)) errors.push(`${at}.ports: hostPort out of range`);
      }
      for (const m of c.volumeMounts || []) {
        if (!volumes.has(m.name)) errors.push(`${at}.volumeMounts: ${m.name} names no volume of the pod`);
        if (!String(m.mountPath || "").startsWith("/")) errors.push(`${at}.volumeMounts.${m.name}: mountPath must be absolute`);
      }
      const mountPaths = (c.volumeMounts || []).map((m) => m.mountPath);
      if (new Set(mountPaths).size !== mountPaths.length) errors.push(`${at}.volumeMounts: duplicate mountPath`);
      const sidecar = field === "initContainers" && c.restartPolicy === "Always";
      if (c.restartPolicy !== undefined && (field !== "initContainers" || c.restartPolicy !== "Always"))
        errors.push(`${at}.restartPolicy: only init containers may set it, and only to Always (native sidecar)`);
      for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
        const p = c[probe];
        if (!p) continue;
        if (field === "initContainers" && !sidecar) errors.push(`${at}.${probe}: probes are only allowed on restartable init containers`);
        const handlers = ["exec", "httpGet", "tcpSocket", "grpc"].filter((h) => p[h]);
        if (handlers.length !== 1) errors.push(`${at}.${probe}: needs exactly one handler, has ${handlers.length}`);
        for (const h of ["httpGet", "tcpSocket"]) {
          const port = p[h] && p[h].port;
          if (typeof port === "string" && !/^[0-9]+$/.test(port) && !own.has(port))
            errors.push(`${at}.${probe}.${h}.port: no container port named ${port}`);
        }
        if ((probe === "livenessProbe" || probe === "startupProbe") && p.successThreshold !== undefined && p.successThreshold !== 1)
          errors.push(`${at}.${probe}.successThreshold: must be 1`);
        if (p.exec && !(p.exec.command || []).length) errors.push(`${at}.${probe}.exec.command: empty`);
      }
      const res = c.resources || {};
      for (const [name, q] of Object.entries(res.limits || {})) {
        if (name.includes("/") && !name.startsWith("kubernetes.io/") && !name.startsWith("requests.")) {
          if (!(Number.isInteger(q) || /^[0-9]+$/.test(String(q))))
            errors.push(`${at}.resources.limits.${name}: an extended resource must be a whole number`);
          const r = (res.requests || {})[name];
          if (r !== undefined && String(r) !== String(q))
            errors.push(`${at}.resources.requests.${name}: must equal the limit for an extended resource`);
        }
      }
      const envNames = (c.env || []).map((e) => e.name);
      if (new Set(envNames).size !== envNames.length) errors.push(`${at}.env: duplicate variable`);
    });
  }
  if (spec.hostNetwork && spec.dnsPolicy && spec.dnsPolicy !== "ClusterFirstWithHostNet" && spec.dnsPolicy !== "Default")
    errors.push(`${where}.dnsPolicy: with hostNetwork use ClusterFirstWithHostNet`);
  if (obj.kind === "Job" || obj.kind === "CronJob") {
    if (!["Never", "OnFailure"].includes(spec.restartPolicy)) errors.push(`${where}.restartPolicy: a Job's pods need Never or OnFailure`);
  }
  if (obj.kind === "DaemonSet" && spec.restartPolicy && spec.restartPolicy !== "Always")
    errors.push(`${where}.restartPolicy: a DaemonSet's pods must use Always`);
  if (obj.spec && obj.spec.selector && obj.spec.selector.matchLabels && obj.kind !== "Job") {
    for (const [k, v] of Object.entries(obj.spec.selector.matchLabels))
      if (pod.labels[k] !== v) errors.push(`spec.selector.matchLabels.${k}=${v} does not match the pod template's labels`);
  }
}

const subset = (sel, labels) => Object.entries(sel || {}).every(([k, v]) => (labels || {})[k] === v);

function crossCheck(objs, report) {
  const pods = objs.map((o) => ({ o, pod: podOf(o) })).filter((x) => x.pod);
  const services = objs.filter((o) => o.kind === "Service");
  const ids = new Map();
  for (const o of objs) {
    const id = `${o.kind}/${(o.metadata || {}).namespace || ""}/${(o.metadata || {}).name}`;
    if (ids.has(id)) report(o, `duplicate object ${id}`);
    ids.set(id, o);
  }
  for (const s of services) {
    const sel = (s.spec || {}).selector;
    if (!sel || !pods.length) continue;
    const matching = pods.filter((x) => subset(sel, x.pod.labels));
    if (!matching.length) {
      report(s, "spec.selector matches no pod template in this render");
      continue;
    }
    for (const p of (s.spec || {}).ports || []) {
      if (typeof p.targetPort === "string") {
        const has = matching.some((x) =>
          [...(x.pod.spec.containers || []), ...(x.pod.spec.initContainers || [])].some((c) =>
            (c.ports || []).some((cp) => cp.name === p.targetPort)));
        if (!has) report(s, `spec.ports.${p.name}: targetPort ${p.targetPort} names no container port of the selected pods`);
      }
    }
  }
  for (const m of objs.filter((o) => o.kind === "ServiceMonitor")) {
    const sel = ((m.spec || {}).selector || {}).matchLabels;
    const matching = services.filter((s) => subset(sel, (s.metadata || {}).labels));
    if (!matching.length) {
      report(m, "spec.selector matches no Service in this render");
      continue;
    }
    for (const e of (m.spec || {}).endpoints || []) {
      if (e.port && !matching.some((s) => ((s.spec || {}).ports || []).some((p) => p.name === e.port)))
        report(m, `spec.endpoints: port ${e.port} is not a port name of the selected Service`);
    }
  }
  for (const m of objs.filter((o) => o.kind === "PodMonitor")) {
    const sel = ((m.spec || {}).selector || {}).matchLabels;
    const matching = pods.filter((x) => subset(sel, x.pod.labels));
    if (!matching.length) continue; // sidecar mode: the trainer pods live elsewhere
    for (const e of (m.spec || {}).podMetricsEndpoints || []) {
      const has = matching.some((x) =>
        [...(x.pod.spec.containers || []), ...(x.pod.spec.initContainers || [])].some((c) =>
          (c.ports || []).some((cp) => cp.name === e.port)));
      if (e.port && !has) report(m, `spec.podMetricsEndpoints: port ${e.port} names no container port of the selected pods`);
    }
  }
  for (const b of objs.filter((o) => o.kind === "PodDisruptionBudget")) {
    const sel = ((b.spec || {}).selector || {}).matchLabels;
    if (pods.length && !pods.some((x) => subset(sel, x.pod.labels))) report(b, "spec.selector matches no pod template in this render");
    if ((b.spec || {}).minAvailable !== undefined && (b.spec || {}).maxUnavailable !== undefined)
      report(b, "spec: minAvailable and maxUnavailable are mutually exclusive");
  }
}

// ------------------------------------------------------------------ snippets

const PLACEHOLDER_IMAGE = "registry.example.com/trainer:latest";

function expandSnippet(cm) {
  const out = [];
  const name = (cm.metadata || {}).name || "snippet";
  const data = cm.data || {};
  const fill = (spec) => {
    for (const c of spec.containers || []) if (!c.image) c.image = PLACEHOLDER_IMAGE;
    return spec;
  };
  if (data["pod-spec.yaml"]) {
    const spec = fill(yaml.load(data["pod-spec.yaml"]));
    out.push({ label: `${name}:pod-spec.yaml`, obj: { apiVersion: "v1", kind: "Pod", metadata: { name: "snippet-check" }, spec } });
  }
  if (data["job-patch.yaml"]) {
    const patch = yaml.load(data["job-patch.yaml"]);
    const job = { apiVersion: "batch/v1", kind: "Job", metadata: { name: "snippet-check" }, spec: patch.spec };
    fill(job.spec.template.spec);
    job.spec.template.spec.restartPolicy = job.spec.template.spec.restartPolicy || "Never";
    out.push({ label: `${name}:job-patch.yaml`, obj: job });
  }
  return out;
}

// ------------------------------------------------------------------ main

function loadDocs(file) {
  const text = fs.readFileSync(file, "utf8");
  return yaml.loadAll(text).filter((d) => d !== null && d !== undefined);
}

async function checkObject(obj) {
  const errors = [];
  if (typeof obj !== "object" || Array.isArray(obj)) return ["document is not a mapping"];
  await schemaCheck(obj, errors);
  checkMetadata(obj, errors);
  checkPod(obj, errors);
  return errors;
}

function describe(obj) {
  return `${obj.kind}/${(obj.metadata || {}).name}`;
}

function dmuondInit(obj) {
  const pod = podOf(obj);
  return pod && (pod.spec.initContainers || []).find((c) => c.name === "dmuond");
}

function diffPaths(a, b, at = "", out = []) {
  if (JSON.stringify(a) === JSON.stringify(b)) return out;
  if (a && b && typeof a === "object" && typeof b === "object" && Array.isArray(a) === Array.isArray(b)) {
    for (const k of new Set([...Object.keys(a), ...Object.keys(b)])) diffPaths(a[k], b[k], `${at}.${k}`, out);
  } else {
    out.push(`${at.replace(/^\./, "")}: example ${JSON.stringify(b)} vs chart ${JSON.stringify(a)}`);
  }
  return out;
}

async function main() {
  const args = process.argv.slice(2);
  const compare = [];
  const files = [];
  for (let i = 0; i < args.length; i++) {
    if (args[i] === "--compare-sidecar") compare.push([args[++i], args[++i]]);
    else files.push(args[i]);
  }
  let objects = 0;
  let failures = 0;
  for (const file of files) {
    let docs;
    try {
      docs = loadDocs(file);
    } catch (e) {
      console.log(`FAIL ${file}: YAML: ${e.message.split("\n")[0]}`);
      failures++;
      continue;
    }
    const lines = [];
    const kinds = [];
    const report = (obj, msg) => lines.push(`  ${describe(obj)}: ${msg}`);
    for (const obj of docs) {
      objects++;
      kinds.push(obj.kind);
      for (const e of await checkObject(obj)) report(obj, e);
      if (obj.kind === "ConfigMap" && ((obj.metadata || {}).labels || {})["dmuon.io/snippet"] === "sidecar") {
        for (const { label, obj: expanded } of expandSnippet(obj)) {
          objects++;
          kinds.push(`${expanded.kind}(${label.split(":")[1]})`);
          for (const e of await checkObject(expanded)) lines.push(`  ${label} as ${expanded.kind}: ${e}`);
        }
      }
    }
    crossCheck(docs, report);
    if (lines.length) {
      failures++;
      console.log(`FAIL ${file}: ${lines.length} problem(s)`);
      for (const l of lines) console.log(l);
    } else {
      console.log(`ok   ${file}: ${docs.length} object(s): ${kinds.join(", ")}`);
    }
  }
  for (const [rendered, example] of compare) {
    const cm = loadDocs(rendered).find((o) => o.kind === "ConfigMap" && ((o.metadata || {}).labels || {})["dmuon.io/snippet"] === "sidecar");
    const job = loadDocs(example).find((o) => podOf(o) && dmuondInit(o));
    const snippet = cm && expandSnippet(cm).find((x) => x.obj.kind === "Job");
    if (!snippet || !job) {
      failures++;
      console.log(`FAIL sidecar example: ${!snippet ? `no sidecar snippet in ${rendered}` : `no dmuond init container in ${example}`}`);
      continue;
    }
    const want = { ...dmuondInit(snippet.obj), image: undefined };
    const got = { ...dmuondInit(job), image: undefined };
    const diffs = diffPaths(JSON.parse(JSON.stringify(want)), JSON.parse(JSON.stringify(got)));
    if (diffs.length) {
      failures++;
      console.log(`FAIL ${example}: its dmuond sidecar differs from the chart's snippet (${rendered}):`);
      for (const d of diffs) console.log(`  ${d}`);
    } else {
      console.log(`ok   ${example}: dmuond sidecar matches the chart's snippet`);
    }
  }
  console.log(`validate: ${objects} object(s) in ${files.length} file(s), ${failures} file(s) with problems`);
  process.exit(failures ? 1 : 0);
}

main().catch((e) => {
  console.error(e.stack || String(e));
  process.exit(2);
});
