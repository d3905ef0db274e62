package main

import (
	"io/ioutil"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// writeChart lays out a throwaway chart: files maps a path inside the chart
// to its content.
func writeChart(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	if _, ok := files["Chart.yaml"]; !ok {
		files["Chart.yaml"] = "apiVersion: v2\nname: demo\nversion: 0.1.0\nappVersion: \"1.2.3\"\nkubeVersion: \">=1.29.0-0\"\n"
	}
	for name, body := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := ioutil.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func render(t *testing.T, dir string, values string, strict bool) (string, error) {
	t.Helper()
	var files []string
	if values != "" {
		f := filepath.Join(t.TempDir(), "v.yaml")
		if err := ioutil.WriteFile(f, []byte(values), 0o644); err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	out, _, err := run(dir, files, "rel", "ns", "v1.30.0", nil, false, false, strict)
	return out, err
}

const cm = `apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name }}-cm
  namespace: {{ .Release.Namespace }}
data:
`

func TestHelmSemantics(t *testing.T) {
	dir := writeChart(t, map[string]string{
		"values.yaml":        "big: 67108864\nport: 50051\nnested:\n  a: 1\n  b: 2\nnullDefault: null\nmsg: hello {{ .Release.Name }}\nlist: [x, y]\n",
		"files/greeting.txt": "hi\n",
		"templates/_h.tpl":   `{{- define "demo.name" -}}{{ .Chart.Name }}-{{ .Chart.AppVersion }}{{- end -}}`,
		"templates/cm.yaml": cm + `  name: {{ include "demo.name" . | quote }}
  raw: {{ .Values.big | quote }}
  int: {{ int64 .Values.big | quote }}
  port: {{ printf "%d" (int .Values.port) | quote }}
  tpl: {{ tpl .Values.msg . | quote }}
  file: {{ .Files.Get "files/greeting.txt" | trim | quote }}
  nested: {{ toYaml .Values.nested | nindent 4 | quote }}
  keys: {{ keys .Values.nested | sortAlpha | join "," | quote }}
  hasNull: {{ hasKey .Values "nullDefault" | quote }}
  hasB: {{ hasKey .Values.nested "b" | quote }}
  fromYaml: {{ (fromYaml "a: [1, 2]").a | len | quote }}
  kube: {{ .Capabilities.KubeVersion.Minor | quote }}
  service: {{ .Release.Service | quote }}
  missing: "{{ .Values.nope }}"
---
# only a comment: dropped
`,
		"templates/empty.yaml": "{{- if false }}\nnever: rendered\n{{- end }}\n",
	})
	out, err := render(t, dir, "nested:\n  b: null\n  c: 3\n", false)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`name: "demo-1.2.3"`,
		`raw: "6.7108864e+07"`, // Helm's float64 values, printed raw
		`int: "67108864"`,
		`port: "50051"`,
		`tpl: "hello rel"`,
		`file: "hi"`,
		`keys: "a,c"`, // a user null deletes the default
		`hasNull: "true"`,
		`hasB: "false"`,
		`fromYaml: "2"`,
		`kube: "30"`,
		`service: "Helm"`,
		`missing: ""`,
		"# Source: demo/templates/cm.yaml",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Count(out, "\n---\n")+1 != 1 || strings.Contains(out, "only a comment") {
		t.Errorf("want exactly one document:\n%s", out)
	}
	if _, err := render(t, dir, "", true); err == nil || !strings.Contains(err.Error(), `map has no entry for key "nope"`) {
		t.Errorf("strict mode: want a missing-key error, got %v", err)
	}
}

func TestFailuresReadLikeHelm(t *testing.T) {
	dir := writeChart(t, map[string]string{
		"values.yaml":        "mode: a\nport: 1\n",
		"values.schema.json": `{"type":"object","properties":{"mode":{"enum":["a","b"]},"port":{"type":"integer"}}}`,
		"templates/cm.yaml": cm + `  x: {{ required "port is required" .Values.absent | quote }}
{{- if eq .Values.mode "b" }}{{ fail "mode b is not allowed" }}{{ end }}
`,
	})
	cases := []struct{ values, want string }{
		{"mode: c\n", "- mode: mode must be one of the following: \"a\", \"b\""},
		{"port: \"1\"\n", "- port: Invalid type. Expected: integer, given: string"},
		{"mode: b\nabsent: 1\n", "execution error at (demo/templates/cm.yaml:8:32): mode b is not allowed"},
		{"", "execution error at (demo/templates/cm.yaml:7:8): port is required"},
	}
	for _, c := range cases {
		_, err := render(t, dir, c.values, false)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("values %q: want an error containing %q, got %v", c.values, c.want, err)
		}
	}
}

func TestKubeVersionConstraint(t *testing.T) {
	dir := writeChart(t, map[string]string{"templates/cm.yaml": cm})
	_, _, err := run(dir, nil, "rel", "ns", "v1.28.3", nil, false, false, false)
	if err == nil || !strings.Contains(err.Error(), "chart requires kubeVersion: >=1.29.0-0 which is incompatible with Kubernetes v1.28.3") {
		t.Errorf("got %v", err)
	}
}

func TestRejectsObjectsWithoutKindOrName(t *testing.T) {
	dir := writeChart(t, map[string]string{"templates/x.yaml": "apiVersion: v1\nmetadata:\n  name: x\n"})
	if _, err := render(t, dir, "", false); err == nil || !strings.Contains(err.Error(), "object has no kind") {
		t.Errorf("got %v", err)
	}
	dir = writeChart(t, map[string]string{"templates/x.yaml": "apiVersion: v1\nkind: A\nmetadata:\n  name: x\n  name: y\n"})
	if _, err := render(t, dir, "", false); err == nil || !strings.Contains(err.Error(), "already defined") {
		t.Errorf("duplicate key: got %v", err)
	}
}
