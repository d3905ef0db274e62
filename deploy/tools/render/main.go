// Command render is an offline stand-in for `helm template`, built only from
// what Debian 12 ships: Go's text/template, Masterminds/sprig, yaml.v2/v3 and
// xeipuuv/gojsonschema (the schema validator Helm 3 used up to 3.14).
//
// It implements the part of Helm's engine the dmuond chart relies on, with
// Helm's semantics:
//   - Chart.yaml as .Chart (Name, Version, AppVersion, KubeVersion, ...),
//     its kubeVersion constraint checked against --kube-version;
//   - values.yaml coalesced with the -f files (later files win, maps merge,
//     a null in a user file deletes the chart default), numbers decoded as
//     float64 as Helm does (so a template that prints a large number without
//     `int` shows the same 1e+06 bug it would show under Helm);
//   - values.schema.json checked against the merged values (draft 4/6/7 via
//     gojsonschema), unless --skip-schema-validation;
//   - .Release (Name, Namespace, Service, IsInstall, IsUpgrade, Revision),
//     .Capabilities (KubeVersion, APIVersions.Has, HelmVersion), .Template,
//     .Files (Get, GetBytes, Glob, Lines, AsConfig, AsSecrets);
//   - functions: sprig's text functions minus env/expandenv, and Helm's
//     include, tpl, required, toYaml, fromYaml, fromYamlArray, toJson,
//     fromJson, fromJsonArray, lookup (always empty, as in `helm template`);
//     `fail` is sprig's. toToml is not provided.
//   - missingkey=zero and "<no value>" removed (--strict: missingkey=error,
//     as `helm lint --strict`), partials (_*) parsed but not rendered,
//     templates parsed and executed in Helm's order;
//   - output split into documents on `---`, empty documents dropped, every
//     document parsed as YAML and required to have apiVersion, kind and
//     metadata.name, each preceded by `# Source: <chart>/templates/<file>`.
//
// Usage:
//
//	render [-f values.yaml]... [--name R] [--namespace NS] [--kube-version V]
//	       [--api-versions G/V]... [--skip-schema-validation] [--strict]
//	       [--notes FILE] [-o FILE] CHART_DIR
//
// Build (GOPATH mode, offline):
//
//	GO111MODULE=off GOPATH=/usr/share/gocode /usr/lib/go-1.19/bin/go build -o /tmp/render ./deploy/tools/render
package main

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io/ioutil"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/semver"
	"github.com/Masterminds/sprig"
	"github.com/xeipuuv/gojsonschema"
	yaml2 "gopkg.in/yaml.v2"
	yaml3 "gopkg.in/yaml.v3"
)

// ---------------------------------------------------------------- chart model

// Metadata mirrors helm.sh/helm/v3/pkg/chart.Metadata: templates see these
// field names (.Chart.Name, .Chart.AppVersion, ...).
type Metadata struct {
	Name         string            `yaml:"name" json:"name"`
	Home         string            `yaml:"home" json:"home,omitempty"`
	Sources      []string          `yaml:"sources" json:"sources,omitempty"`
	Version      string            `yaml:"version" json:"version"`
	Description  string            `yaml:"description" json:"description,omitempty"`
	Keywords     []string          `yaml:"keywords" json:"keywords,omitempty"`
	Maintainers  []Maintainer      `yaml:"maintainers" json:"maintainers,omitempty"`
	Icon         string            `yaml:"icon" json:"icon,omitempty"`
	APIVersion   string            `yaml:"apiVersion" json:"apiVersion"`
	Condition    string            `yaml:"condition" json:"condition,omitempty"`
	Tags         string            `yaml:"tags" json:"tags,omitempty"`
	AppVersion   string            `yaml:"appVersion" json:"appVersion,omitempty"`
	Deprecated   bool              `yaml:"deprecated" json:"deprecated,omitempty"`
	Annotations  map[string]string `yaml:"annotations" json:"annotations,omitempty"`
	KubeVersion  string            `yaml:"kubeVersion" json:"kubeVersion,omitempty"`
	Dependencies []interface{}     `yaml:"dependencies" json:"dependencies,omitempty"`
	Type         string            `yaml:"type" json:"type,omitempty"`
}

type Maintainer struct {
	Name  string `yaml:"name" json:"name"`
	Email string `yaml:"email" json:"email,omitempty"`
	URL   string `yaml:"url" json:"url,omitempty"`
}

// KubeVersion mirrors chartutil.KubeVersion.
type KubeVersion struct {
	Version    string
	Major      string
	Minor      string
	GitVersion string
}

func (k KubeVersion) String() string { return k.Version }

// VersionSet mirrors chartutil.VersionSet.
type VersionSet []string

func (v VersionSet) Has(apiVersion string) bool {
	for _, x := range v {
		if x == apiVersion {
			return true
		}
	}
	return false
}

type HelmVersion struct {
	Version      string
	GitCommit    string
	GitTreeState string
	GoVersion    string
}

type Capabilities struct {
	KubeVersion KubeVersion
	APIVersions VersionSet
	HelmVersion HelmVersion
}

type Release struct {
	Name      string
	Namespace string
	Revision  int
	IsUpgrade bool
	IsInstall bool
	Service   string
}

// Files mirrors engine.files: the chart's non-template files by path.
type Files map[string][]byte

func (f Files) GetBytes(name string) []byte { return f[name] }
func (f Files) Get(name string) string      { return string(f[name]) }

func (f Files) Glob(pattern string) Files {
	out := Files{}
	for name, data := range f {
		if ok, _ := path.Match(pattern, name); ok {
			out[name] = data
		} else if ok, _ := filepath.Match(pattern, name); ok {
			out[name] = data
		}
	}
	return out
}

func (f Files) Lines(name string) []string {
	s := string(f[name])
	if s == "" {
		return []string{}
	}
	return strings.Split(strings.TrimRight(s, "\n"), "\n")
}

func (f Files) AsConfig() string {
	m := map[string]string{}
	for name, data := range f {
		m[path.Base(name)] = string(data)
	}
	return toYAML(m)
}

func (f Files) AsSecrets() string {
	m := map[string]string{}
	for name, data := range f {
		m[path.Base(name)] = base64.StdEncoding.EncodeToString(data)
	}
	return toYAML(m)
}

// ---------------------------------------------------------------- YAML/JSON

// jsonify turns a yaml.v3-decoded tree into what Helm holds after
// sigs.k8s.io/yaml: JSON types only, numbers as float64.
func jsonify(v interface{}) (interface{}, error) {
	clean, err := stringKeys(v)
	if err != nil {
		return nil, err
	}
	b, err := json.Marshal(clean)
	if err != nil {
		return nil, err
	}
	var out interface{}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, err
	}
	return out, nil
}

func stringKeys(v interface{}) (interface{}, error) {
	switch t := v.(type) {
	case map[string]interface{}:
		out := make(map[string]interface{}, len(t))
		for k, x := range t {
			c, err := stringKeys(x)
			if err != nil {
				return nil, err
			}
			out[k] = c
		}
		return out, nil
	case map[interface{}]interface{}:
		out := make(map[string]interface{}, len(t))
		for k, x := range t {
			c, err := stringKeys(x)
			if err != nil {
				return nil, err
			}
			out[fmt.Sprint(k)] = c
		}
		return out, nil
	case []interface{}:
		out := make([]interface{}, len(t))
		for i, x := range t {
			c, err := stringKeys(x)
			if err != nil {
				return nil, err
			}
			out[i] = c
		}
		return out, nil
	default:
		return v, nil
	}
}

func parseYAMLMap(data []byte) (map[string]interface{}, error) {
	var raw interface{}
	if err := yaml3.Unmarshal(data, &raw); err != nil {
		return nil, err
	}
	if raw == nil {
		return map[string]interface{}{}, nil
	}
	j, err := jsonify(raw)
	if err != nil {
		return nil, err
	}
	m, ok := j.(map[string]interface{})
	if !ok {
		return nil, fmt.Errorf("top level is a %T, not a mapping", j)
	}
	return m, nil
}

// marshalYAML follows sigs.k8s.io/yaml.Marshal: to JSON, then JSON to YAML
// with yaml.v2 (keys sorted, sequences not indented under their key).
func marshalYAML(v interface{}) ([]byte, error) {
	j, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	var obj interface{}
	if err := yaml2.Unmarshal(j, &obj); err != nil {
		return nil, err
	}
	return yaml2.Marshal(obj)
}

// Helm's toYaml: errors become "", trailing newline trimmed.
func toYAML(v interface{}) string {
	b, err := marshalYAML(v)
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(b), "\n")
}

func fromYAML(s string) map[string]interface{} {
	m, err := parseYAMLMap([]byte(s))
	if err != nil {
		return map[string]interface{}{"Error": err.Error()}
	}
	return m
}

func fromYAMLArray(s string) []interface{} {
	var raw interface{}
	if err := yaml3.Unmarshal([]byte(s), &raw); err != nil {
		return []interface{}{err.Error()}
	}
	j, err := jsonify(raw)
	if err != nil {
		return []interface{}{err.Error()}
	}
	a, ok := j.([]interface{})
	if !ok {
		return []interface{}{fmt.Sprintf("not a sequence: %T", j)}
	}
	return a
}

func toJSON(v interface{}) string {
	b, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	return string(b)
}

func fromJSON(s string) map[string]interface{} {
	m := map[string]interface{}{}
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		m["Error"] = err.Error()
	}
	return m
}

func fromJSONArray(s string) []interface{} {
	a := []interface{}{}
	if err := json.Unmarshal([]byte(s), &a); err != nil {
		a = []interface{}{err.Error()}
	}
	return a
}

// ---------------------------------------------------------------- values

// mergeMaps: how Helm merges several -f files (later wins, maps recurse).
func mergeMaps(a, b map[string]interface{}) map[string]interface{} {
	out := make(map[string]interface{}, len(a))
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		if bv, ok := v.(map[string]interface{}); ok {
			if av, ok := out[k].(map[string]interface{}); ok {
				out[k] = mergeMaps(av, bv)
				continue
			}
		}
		out[k] = v
	}
	return out
}

// coalesce: user values over chart defaults, as chartutil.CoalesceRoot. A
// user null deletes the default; a null in the chart's own values.yaml stays
// (a key present with a nil value), as in Helm.
func coalesce(user, defaults map[string]interface{}, prefix string, warn func(string)) map[string]interface{} {
	out := make(map[string]interface{}, len(user))
	for k, v := range user {
		out[k] = v
	}
	for k, dv := range defaults {
		uv, present := out[k]
		if !present {
			out[k] = deepCopy(dv)
			continue
		}
		if uv == nil {
			delete(out, k)
			continue
		}
		um, uIsMap := uv.(map[string]interface{})
		dm, dIsMap := dv.(map[string]interface{})
		switch {
		case uIsMap && dIsMap:
			out[k] = coalesce(um, dm, prefix+k+".", warn)
		case uIsMap && dv != nil:
			warn(fmt.Sprintf("overwriting %s%s: a table replaces a non-table default", prefix, k))
		case !uIsMap && dIsMap:
			warn(fmt.Sprintf("cannot overwrite table %s%s with non-table %v", prefix, k, uv))
		}
	}
	return out
}

func deepCopy(v interface{}) interface{} {
	switch t := v.(type) {
	case map[string]interface{}:
		out := make(map[string]interface{}, len(t))
		for k, x := range t {
			out[k] = deepCopy(x)
		}
		return out
	case []interface{}:
		out := make([]interface{}, len(t))
		for i, x := range t {
			out[i] = deepCopy(x)
		}
		return out
	default:
		return v
	}
}

// validateSchema reproduces chartutil.ValidateAgainstSingleSchema's report.
func validateSchema(values map[string]interface{}, schema []byte) error {
	res, err := gojsonschema.Validate(gojsonschema.NewBytesLoader(schema), gojsonschema.NewGoLoader(values))
	if err != nil {
		return fmt.Errorf("values.schema.json: %v", err)
	}
	if res.Valid() {
		return nil
	}
	var sb strings.Builder
	for _, e := range res.Errors() {
		sb.WriteString(fmt.Sprintf("- %s\n", e))
	}
	return errors.New(sb.String())
}

// ---------------------------------------------------------------- engine

const errStart, errEnd = "HELM_ERR_START", "HELM_ERR_END"

var errWrapped = regexp.MustCompile(errStart + `(?s)(.*)` + errEnd)

type engine struct {
	t        *template.Template
	included map[string]int
	tplCount int
}

func (e *engine) funcMap() template.FuncMap {
	f := sprig.TxtFuncMap()
	delete(f, "env")
	delete(f, "expandenv")
	extra := template.FuncMap{
		"toYaml":        toYAML,
		"fromYaml":      fromYAML,
		"fromYamlArray": fromYAMLArray,
		"toJson":        toJSON,
		"fromJson":      fromJSON,
		"fromJsonArray": fromJSONArray,
		"toToml": func(interface{}) (string, error) {
			return "", errors.New("toToml is not implemented by the offline renderer")
		},
		"include": e.include,
		"tpl":     e.tpl,
		"required": func(msg string, v interface{}) (interface{}, error) {
			if v == nil {
				return v, errors.New(errStart + msg + errEnd)
			}
			if s, ok := v.(string); ok && s == "" {
				return v, errors.New(errStart + msg + errEnd)
			}
			return v, nil
		},
		"fail": func(msg string) (string, error) {
			return "", errors.New(errStart + msg + errEnd)
		},
		"lookup": func(string, string, string, string) (map[string]interface{}, error) {
			return map[string]interface{}{}, nil
		},
	}
	for k, v := range extra {
		f[k] = v
	}
	return f
}

func (e *engine) include(name string, data interface{}) (string, error) {
	if e.included[name] > 1000 {
		return "", fmt.Errorf("rendering template has a nested reference name: %s", name)
	}
	e.included[name]++
	defer func() { e.included[name]-- }()
	var buf strings.Builder
	err := e.t.ExecuteTemplate(&buf, name, data)
	return buf.String(), err
}

func (e *engine) tpl(text string, vals map[string]interface{}) (string, error) {
	clone, err := e.t.Clone()
	if err != nil {
		return "", err
	}
	e.tplCount++
	name := fmt.Sprintf("tpl-%d", e.tplCount)
	if tmpl, ok := vals["Template"].(map[string]interface{}); ok {
		if n, ok := tmpl["Name"].(string); ok {
			name = fmt.Sprintf("%s#tpl-%d", n, e.tplCount)
		}
	}
	if _, err := clone.New(name).Parse(text); err != nil {
		return "", fmt.Errorf("error during tpl function execution for %q: %v", text, err)
	}
	var buf strings.Builder
	if err := clone.ExecuteTemplate(&buf, name, vals); err != nil {
		return "", fmt.Errorf("error during tpl function execution for %q: %v", text, err)
	}
	return strings.ReplaceAll(buf.String(), "<no value>", ""), nil
}

// cleanError turns a text/template error into Helm's "execution error at
// (file:line:col): message" form.
func cleanError(file string, err error) error {
	msg := err.Error()
	if m := errWrapped.FindStringSubmatch(msg); m != nil {
		loc := file
		if parts := strings.SplitN(msg, ": ", 3); len(parts) == 3 && strings.HasPrefix(parts[0], "template") {
			loc = parts[1]
		}
		return fmt.Errorf("execution error at (%s): %s", loc, m[1])
	}
	return fmt.Errorf("%s: %v", file, err)
}

// Helm's parse order (sort.Reverse(byPathLen)): deeper paths first, then
// reverse lexical; it decides which of two same-named defines wins.
func sortTemplates(names []string) {
	sort.SliceStable(names, func(i, j int) bool {
		a, b := names[i], names[j]
		ca, cb := strings.Count(a, "/"), strings.Count(b, "/")
		if ca != cb {
			return ca > cb
		}
		return a > b
	})
}

// ---------------------------------------------------------------- main

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(s string) error { *m = append(*m, s); return nil }

var docSep = regexp.MustCompile(`(?m)^---[ \t]*(#.*)?$`)

func main() {
	var valueFiles, apiVersions multiFlag
	release := flag.String("name", "dmuond", "release name")
	namespace := flag.String("namespace", "default", "release namespace")
	kubeVersion := flag.String("kube-version", "v1.30.0", "Kubernetes version for .Capabilities and the chart's kubeVersion check")
	skipSchema := flag.Bool("skip-schema-validation", false, "do not validate values against values.schema.json")
	notesOut := flag.String("notes", "", "also write the rendered NOTES.txt to this file")
	outFile := flag.String("o", "", "write the manifests here instead of stdout")
	printValues := flag.Bool("print-values", false, "print the coalesced values as YAML and exit")
	strict := flag.Bool("strict", false, "fail on references to missing values (missingkey=error, as helm lint --strict)")
	flag.Var(&valueFiles, "f", "values file (repeatable; later files win)")
	flag.Var(&valueFiles, "values", "same as -f")
	flag.Var(&apiVersions, "api-versions", "extra API version for .Capabilities.APIVersions (repeatable)")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: render [flags] CHART_DIR\n")
		flag.PrintDefaults()
	}
	// Accept flags after the chart directory, as helm does.
	args := os.Args[1:]
	var positional []string
	for len(args) > 0 {
		if err := flag.CommandLine.Parse(args); err != nil {
			os.Exit(2)
		}
		args = flag.Args()
		if len(args) > 0 {
			positional = append(positional, args[0])
			args = args[1:]
		}
	}
	if len(positional) != 1 {
		flag.Usage()
		os.Exit(2)
	}
	out, notes, err := run(positional[0], valueFiles, *release, *namespace, *kubeVersion, apiVersions, *skipSchema, *printValues, *strict)
	if err != nil {
		fmt.Fprintf(os.Stderr, "Error: %v\n", err)
		os.Exit(1)
	}
	if *notesOut != "" {
		if err := ioutil.WriteFile(*notesOut, []byte(notes), 0o644); err != nil {
			fmt.Fprintf(os.Stderr, "Error: %v\n", err)
			os.Exit(1)
		}
	}
	if *outFile != "" {
		err = ioutil.WriteFile(*outFile, []byte(out), 0o644)
	} else {
		_, err = os.Stdout.WriteString(out)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "Error: %v\n", err)
		os.Exit(1)
	}
}

func run(chartDir string, valueFiles []string, releaseName, namespace, kubeVersion string,
	apiVersions []string, skipSchema, printValues, strict bool) (string, string, error) {
	// Chart.yaml
	raw, err := ioutil.ReadFile(filepath.Join(chartDir, "Chart.yaml"))
	if err != nil {
		return "", "", err
	}
	var meta Metadata
	if err := yaml3.Unmarshal(raw, &meta); err != nil {
		return "", "", fmt.Errorf("Chart.yaml: %v", err)
	}
	if meta.APIVersion != "v2" {
		return "", "", fmt.Errorf("Chart.yaml: apiVersion must be v2, got %q", meta.APIVersion)
	}
	if meta.Name == "" || meta.Version == "" {
		return "", "", errors.New("Chart.yaml: name and version are required")
	}
	if _, err := semver.StrictNewVersion(meta.Version); err != nil {
		return "", "", fmt.Errorf("Chart.yaml: version %q is not SemVer 2: %v", meta.Version, err)
	}

	kv, err := semver.NewVersion(kubeVersion)
	if err != nil {
		return "", "", fmt.Errorf("--kube-version %q: %v", kubeVersion, err)
	}
	if meta.KubeVersion != "" {
		c, err := semver.NewConstraint(meta.KubeVersion)
		if err != nil {
			return "", "", fmt.Errorf("Chart.yaml: kubeVersion %q: %v", meta.KubeVersion, err)
		}
		if !c.Check(kv) {
			return "", "", fmt.Errorf("chart requires kubeVersion: %s which is incompatible with Kubernetes v%s", meta.KubeVersion, kv)
		}
	}

	// Values.
	defaults := map[string]interface{}{}
	if b, err := ioutil.ReadFile(filepath.Join(chartDir, "values.yaml")); err == nil {
		if defaults, err = parseYAMLMap(b); err != nil {
			return "", "", fmt.Errorf("values.yaml: %v", err)
		}
	}
	user := map[string]interface{}{}
	for _, f := range valueFiles {
		b, err := ioutil.ReadFile(f)
		if err != nil {
			return "", "", err
		}
		m, err := parseYAMLMap(b)
		if err != nil {
			return "", "", fmt.Errorf("failed to parse %s: %v", f, err)
		}
		user = mergeMaps(user, m)
	}
	values := coalesce(user, defaults, "", func(w string) { fmt.Fprintf(os.Stderr, "coalesce.go: warning: %s\n", w) })
	if printValues {
		return toYAML(values) + "\n", "", nil
	}
	if !skipSchema {
		if schema, err := ioutil.ReadFile(filepath.Join(chartDir, "values.schema.json")); err == nil {
			if err := validateSchema(values, schema); err != nil {
				return "", "", fmt.Errorf("values don't meet the specifications of the schema(s) in the following chart(s):\n%s:\n%v", meta.Name, err)
			}
		}
	}

	// Templates and files.
	templates := map[string]string{}
	files := Files{}
	err = filepath.Walk(chartDir, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(chartDir, p)
		rel = filepath.ToSlash(rel)
		if info.IsDir() {
			if rel == "charts" || rel == "ci" || strings.HasPrefix(info.Name(), ".") && rel != "." {
				return filepath.SkipDir
			}
			return nil
		}
		data, err := ioutil.ReadFile(p)
		if err != nil {
			return err
		}
		switch {
		case strings.HasPrefix(rel, "templates/"):
			templates[meta.Name+"/"+rel] = string(data)
		case rel == "Chart.yaml" || rel == "values.yaml" || rel == "values.schema.json":
		default:
			files[rel] = data
		}
		return nil
	})
	if err != nil {
		return "", "", err
	}
	if _, err := os.Stat(filepath.Join(chartDir, "charts")); err == nil {
		return "", "", errors.New("subcharts (charts/) are not supported by the offline renderer")
	}

	versions := VersionSet{"v1", "apps/v1", "batch/v1", "policy/v1", "rbac.authorization.k8s.io/v1",
		"networking.k8s.io/v1", "scheduling.k8s.io/v1", "storage.k8s.io/v1"}
	versions = append(versions, apiVersions...)
	top := map[string]interface{}{
		"Chart": &meta,
		"Release": Release{Name: releaseName, Namespace: namespace, Revision: 1,
			IsInstall: true, Service: "Helm"},
		"Capabilities": Capabilities{
			KubeVersion: KubeVersion{Version: "v" + kv.String(), Major: fmt.Sprint(kv.Major()),
				Minor: fmt.Sprint(kv.Minor()), GitVersion: "v" + kv.String()},
			APIVersions: versions,
			HelmVersion: HelmVersion{Version: "v3.14.0-offline", GoVersion: "go1.19"},
		},
		"Values": values,
		"Files":  files,
	}

	e := &engine{included: map[string]int{}}
	e.t = template.New("gotpl").Option("missingkey=zero")
	if strict {
		e.t.Option("missingkey=error")
	}
	e.t.Funcs(e.funcMap())
	names := make([]string, 0, len(templates))
	for n := range templates {
		names = append(names, n)
	}
	sortTemplates(names)
	for _, n := range names {
		if _, err := e.t.New(n).Parse(templates[n]); err != nil {
			return "", "", fmt.Errorf("parse error in %s: %v", n, err)
		}
	}

	// Execute every template first, in Helm's order (so the first failing
	// template is the one Helm would report), then split and parse.
	rendered := map[string]string{}
	for _, n := range names {
		if strings.HasPrefix(path.Base(n), "_") {
			continue
		}
		top["Template"] = map[string]interface{}{"Name": n, "BasePath": meta.Name + "/templates"}
		var buf strings.Builder
		if err := e.t.ExecuteTemplate(&buf, n, top); err != nil {
			return "", "", cleanError(n, err)
		}
		rendered[n] = strings.ReplaceAll(buf.String(), "<no value>", "")
	}

	sort.Strings(names)
	var manifests strings.Builder
	notes := ""
	docs := 0
	for _, n := range names {
		base := path.Base(n)
		text, ok := rendered[n]
		if !ok {
			continue
		}
		if base == "NOTES.txt" {
			notes = text
			continue
		}
		if !strings.HasSuffix(base, ".yaml") && !strings.HasSuffix(base, ".yml") && !strings.HasSuffix(base, ".tpl") {
			continue
		}
		for i, doc := range docSep.Split(text, -1) {
			if isEmptyDoc(doc) {
				continue
			}
			if err := checkDoc(doc); err != nil {
				return "", "", fmt.Errorf("YAML parse error on %s (document %d): %v\n%s", n, i+1, err, numbered(doc))
			}
			manifests.WriteString("---\n# Source: " + n + "\n")
			manifests.WriteString(strings.Trim(doc, "\n") + "\n")
			docs++
		}
	}
	if docs == 0 {
		return "", "", errors.New("the chart rendered no objects")
	}
	return manifests.String(), notes, nil
}

func isEmptyDoc(doc string) bool {
	for _, line := range strings.Split(doc, "\n") {
		l := strings.TrimSpace(line)
		if l != "" && !strings.HasPrefix(l, "#") {
			return false
		}
	}
	return true
}

func checkDoc(doc string) error {
	var obj map[string]interface{}
	dec := yaml3.NewDecoder(bytes.NewReader([]byte(doc)))
	if err := dec.Decode(&obj); err != nil {
		return err
	}
	if obj == nil {
		return errors.New("not a mapping")
	}
	for _, k := range []string{"apiVersion", "kind"} {
		if s, _ := obj[k].(string); s == "" {
			return fmt.Errorf("object has no %s", k)
		}
	}
	md, _ := obj["metadata"].(map[string]interface{})
	if name, _ := md["name"].(string); name == "" {
		return errors.New("object has no metadata.name")
	}
	return nil
}

func numbered(doc string) string {
	var sb strings.Builder
	for i, l := range strings.Split(doc, "\n") {
		sb.WriteString(fmt.Sprintf("%4d | %s\n", i+1, l))
	}
	return sb.String()
}
