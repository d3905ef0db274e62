{{/*
Names and labels.
*/}}
{{- define "dmuond.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dmuond.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "dmuond.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dmuond.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dmuond.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dmuond.labels" -}}
helm.sh/chart: {{ include "dmuond.chart" . }}
{{ include "dmuond.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: optimizer-daemon
app.kubernetes.io/part-of: dmuon
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "dmuond.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dmuond.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "dmuond.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/*
Addresses. IPv6 hosts are bracketed. Exec probes and the sidecar's clients
dial loopback when the daemon listens on every address.
*/}}
{{- define "dmuond.hostPort" -}}
{{- $host := index . 0 -}}
{{- $port := index . 1 | int -}}
{{- if contains ":" $host -}}
{{- printf "[%s]:%d" $host $port -}}
{{- else -}}
{{- printf "%s:%d" $host $port -}}
{{- end -}}
{{- end -}}

{{- define "dmuond.listenAddress" -}}
{{- include "dmuond.hostPort" (list .Values.daemon.listenHost .Values.ports.grpc) -}}
{{- end -}}

{{/*
"true" when dmuond listens beyond loopback without TLS and authentication
(tokens or mTLS): it then needs --insecure.
*/}}
{{- define "dmuond.insecure" -}}
{{- $host := .Values.daemon.listenHost -}}
{{- $loopback := or (eq $host "localhost") (eq $host "::1") (eq $host "[::1]") (hasPrefix "127." $host) -}}
{{- $secure := and .Values.tls.enabled (or .Values.auth.enabled .Values.tls.clientCA) -}}
{{- if and (not $loopback) (not $secure) -}}true{{- else -}}false{{- end -}}
{{- end -}}

{{- define "dmuond.localAddress" -}}
{{- $host := .Values.daemon.listenHost -}}
{{- if has $host (list "0.0.0.0" "::" "[::]") -}}
{{- $host = "127.0.0.1" -}}
{{- end -}}
{{- include "dmuond.hostPort" (list $host .Values.ports.grpc) -}}
{{- end -}}

{{/*
dmuond's command line: every flag of the daemon, from values.
*/}}
{{- define "dmuond.args" -}}
{{- $d := .Values.daemon -}}
- {{ printf "--listen=%s" (include "dmuond.listenAddress" .) | quote }}
- {{ printf "--devices=%s" $d.devices | quote }}
{{- if gt (int $d.cpuThreads) 0 }}
- {{ printf "--cpu-threads=%d" (int $d.cpuThreads) | quote }}
{{- end }}
{{- if gt (int $d.cpuExecutors) 0 }}
- {{ printf "--cpu-executors=%d" (int $d.cpuExecutors) | quote }}
{{- end }}
{{- if gt (int $d.maxBatch) 0 }}
- {{ printf "--max-batch=%d" (int $d.maxBatch) | quote }}
{{- end }}
{{- if .Values.metrics.enabled }}
- {{ printf "--metrics-port=%d" (int .Values.ports.metrics) | quote }}
{{- if .Values.metrics.tls }}
- "--metrics-tls"
{{- end }}
{{- if .Values.metrics.auth }}
- "--metrics-auth"
{{- end }}
{{- else }}
- "--metrics-port=0"
{{- end }}
{{- if .Values.state.enabled }}
- {{ printf "--state-dir=%s" .Values.state.mountPath | quote }}
{{- if gt (int .Values.state.snapshotEvery) 0 }}
- {{ printf "--snapshot-every=%d" (int .Values.state.snapshotEvery) | quote }}
{{- end }}
{{- end }}
{{- if gt (int $d.maxSessions) 0 }}
- {{ printf "--max-sessions=%d" (int $d.maxSessions) | quote }}
{{- end }}
{{- if gt (int64 $d.maxMessageBytes) 0 }}
- {{ printf "--max-message-bytes=%d" (int64 $d.maxMessageBytes) | quote }}
{{- end }}
- {{ printf "--exit-timeout-secs=%d" (int $d.exitTimeoutSecs) | quote }}
- {{ printf "--job-retention-seconds=%d" (int $d.jobRetentionSeconds) | quote }}
- {{ printf "--max-world-size=%d" (int $d.maxWorldSize) | quote }}
- {{ printf "--max-job-parameters=%d" (int $d.maxJobParameters) | quote }}
- {{ printf "--max-job-elements=%d" (int64 $d.maxJobElements) | quote }}
- {{ printf "--max-state-bytes=%d" (int64 $d.maxStateBytes) | quote }}
- {{ printf "--max-ns-steps=%d" (int $d.maxNsSteps) | quote }}
- {{ printf "--max-job-id-bytes=%d" (int $d.maxJobIdBytes) | quote }}
- {{ printf "--max-idle-jobs=%d" (int $d.maxIdleJobs) | quote }}
- {{ printf "--attach-timeout-seconds=%d" (int $d.attachTimeoutSeconds) | quote }}
- {{ printf "--max-step-queue-bytes=%d" (int64 $d.maxStepQueueBytes) | quote }}
- {{ printf "--nan-policy=%s" $d.nanPolicy | quote }}
- {{ printf "--log-level=%s" $d.logLevel | quote }}
- {{ printf "--log-format=%s" $d.logFormat | quote }}
{{- if ge (int $d.summaryEverySecs) 0 }}
- {{ printf "--summary-every-secs=%d" (int $d.summaryEverySecs) | quote }}
{{- end }}
{{- if .Values.tls.enabled }}
- {{ printf "--tls-cert-file=%s/tls.crt" .Values.tls.mountPath | quote }}
- {{ printf "--tls-key-file=%s/tls.key" .Values.tls.mountPath | quote }}
{{- if .Values.tls.clientCA }}
- {{ printf "--tls-client-ca-file=%s/ca.crt" .Values.tls.mountPath | quote }}
{{- end }}
{{- end }}
{{- if .Values.auth.enabled }}
- {{ printf "--auth-token-file=%s/%s" .Values.auth.mountPath .Values.auth.key | quote }}
{{- end }}
{{- if eq (include "dmuond.insecure" .) "true" }}
- "--insecure"
{{- end }}
{{- range $d.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/*
One probe. Called with (list $ "startup"|"readiness"|"liveness").
*/}}
{{- define "dmuond.probe" -}}
{{- $root := index . 0 -}}
{{- $p := index $root.Values.probes (index . 1) -}}
{{- if eq $root.Values.probes.type "grpc" -}}
grpc:
  port: {{ int $root.Values.ports.grpc }}
  {{- with $p.service }}
  service: {{ . | quote }}
  {{- end }}
{{- else -}}
exec:
  command:
    - dmuonctl
    - {{ printf "--server=%s" (include "dmuond.localAddress" $root) | quote }}
    {{- range $root.Values.probes.execArgs }}
    - {{ . | quote }}
    {{- end }}
    - health
{{- end }}
initialDelaySeconds: {{ int $p.initialDelaySeconds }}
periodSeconds: {{ int $p.periodSeconds }}
timeoutSeconds: {{ int $p.timeoutSeconds }}
failureThreshold: {{ int $p.failureThreshold }}
{{- with index $p "successThreshold" }}
successThreshold: {{ int . }}
{{- end }}
{{- end -}}

{{/*
Resources: values' resources plus the GPU limit and DRA claims.
*/}}
{{- define "dmuond.resources" -}}
{{- $res := deepCopy (default dict .Values.resources) -}}
{{- if gt (int .Values.gpu.count) 0 -}}
{{- $limits := default dict (get $res "limits") -}}
{{- $_ := set $limits .Values.gpu.resourceName (int .Values.gpu.count) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- with .Values.gpu.claims -}}
{{- $claims := list -}}
{{- range . -}}
{{- $claims = append $claims (dict "name" .) -}}
{{- end -}}
{{- $_ := set $res "claims" $claims -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/*
The dmuond container, shared by the DaemonSet and the sidecar snippet (where
it becomes a native sidecar: restartPolicy Always). Volume names are
prefixed dmuon- so they cannot clash with a trainer pod's own.
*/}}
{{- define "dmuond.container" -}}
name: dmuond
image: {{ include "dmuond.image" . | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- if eq .Values.mode "sidecar" }}
restartPolicy: Always
{{- end }}
args:
  {{- include "dmuond.args" . | nindent 2 }}
env:
  - name: NODE_NAME
    valueFrom:
      fieldRef:
        fieldPath: spec.nodeName
  - name: POD_NAME
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  - name: POD_NAMESPACE
    valueFrom:
      fieldRef:
        fieldPath: metadata.namespace
  {{- if and (eq (int .Values.gpu.count) 0) (not .Values.gpu.claims) }}
  # No GPU requested: keep the NVIDIA runtime from exposing every GPU.
  - name: NVIDIA_VISIBLE_DEVICES
    value: void
  {{- end }}
  {{- with .Values.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
ports:
  - name: dmuon-grpc
    containerPort: {{ int .Values.ports.grpc }}
    protocol: TCP
    {{- if and (eq .Values.mode "daemonset") .Values.daemonset.hostPort }}
    hostPort: {{ int .Values.ports.grpc }}
    {{- end }}
  {{- if .Values.metrics.enabled }}
  - name: dmuon-metrics
    containerPort: {{ int .Values.ports.metrics }}
    protocol: TCP
  {{- end }}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{- if (index $.Values.probes $kind).enabled }}
{{ $kind }}Probe:
  {{- include "dmuond.probe" (list $ $kind) | nindent 2 }}
{{- end }}
{{- end }}
resources:
  {{- include "dmuond.resources" . | nindent 2 }}
{{- $sc := deepCopy (default dict .Values.securityContext) -}}
{{- if eq .Values.mode "sidecar" -}}
{{- /* The pod's securityContext is the trainer's: carry the user over. */ -}}
{{- $sc = merge $sc (pick (default dict .Values.podSecurityContext) "runAsUser" "runAsGroup" "runAsNonRoot" "seccompProfile") -}}
{{- end }}
{{- with $sc }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumeMounts:
  - name: dmuon-tmp
    mountPath: /tmp
  {{- if eq .Values.mode "sidecar" }}
  - name: dmuon-shm
    mountPath: /dev/shm
  {{- end }}
  {{- if .Values.state.enabled }}
  - name: dmuon-state
    mountPath: {{ .Values.state.mountPath }}
  {{- end }}
  {{- if .Values.tls.enabled }}
  - name: dmuon-tls
    mountPath: {{ .Values.tls.mountPath }}
    readOnly: true
  {{- end }}
  {{- if .Values.auth.enabled }}
  - name: dmuon-auth
    mountPath: {{ .Values.auth.mountPath }}
    readOnly: true
  {{- end }}
  {{- with .Values.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/*
Pod volumes for the container above (the sidecar adds dmuon-shm).
*/}}
{{- define "dmuond.volumes" -}}
- name: dmuon-tmp
  emptyDir: {}
{{- if eq .Values.mode "sidecar" }}
- name: dmuon-shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.sidecar.shmSizeLimit }}
{{- end }}
{{- if .Values.state.enabled }}
- name: dmuon-state
{{- if .Values.state.hostPath }}
  hostPath:
    path: {{ .Values.state.hostPath }}
    {{- with .Values.state.hostPathType }}
    type: {{ . }}
    {{- end }}
{{- else }}
  {{- toYaml .Values.state.volume | nindent 2 }}
{{- end }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: dmuon-tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    {{- if eq .Values.mode "sidecar" }}
    # 0444: the trainer pod may set no fsGroup for the daemon's group.
    defaultMode: 292
    {{- else }}
    # 0440: readable by the daemon's group (fsGroup).
    defaultMode: 288
    {{- end }}
{{- end }}
{{- if .Values.auth.enabled }}
- name: dmuon-auth
  secret:
    secretName: {{ .Values.auth.secretName }}
    {{- if eq .Values.mode "sidecar" }}
    defaultMode: 292
    {{- else }}
    defaultMode: 288
    {{- end }}
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Init container that hands a hostPath state directory to the daemon's user.
*/}}
{{- define "dmuond.fixPermissions" -}}
{{- $uid := int (default 65532 .Values.podSecurityContext.runAsUser) -}}
{{- $gid := int (default $uid .Values.podSecurityContext.runAsGroup) -}}
name: dmuond-state-permissions
image: {{ include "dmuond.image" . | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
command:
  - chown
  - {{ printf "%d:%d" $uid $gid | quote }}
  - {{ .Values.state.mountPath | quote }}
securityContext:
  runAsNonRoot: false
  runAsUser: 0
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop:
      - ALL
    add:
      - CHOWN
volumeMounts:
  - name: dmuon-state
    mountPath: {{ .Values.state.mountPath }}
{{- end -}}

{{- define "dmuond.needsFixPermissions" -}}
{{- if and .Values.state.enabled .Values.state.hostPath .Values.state.fixPermissions -}}
true
{{- end -}}
{{- end -}}

{{/*
The pod-spec fragment of sidecar mode: what a trainer pod adds.
*/}}
{{- define "dmuond.sidecarPodSpec" -}}
shareProcessNamespace: {{ .Values.sidecar.shareProcessNamespace }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
initContainers:
  {{- if include "dmuond.needsFixPermissions" . }}
  - {{ include "dmuond.fixPermissions" . | indent 4 | trim }}
  {{- end }}
  - {{ include "dmuond.container" . | indent 4 | trim }}
containers:
  - name: {{ .Values.sidecar.trainerContainerName }}
    env:
      - name: DMUON_SERVER
        value: {{ include "dmuond.localAddress" . | quote }}
    volumeMounts:
      - name: dmuon-shm
        mountPath: /dev/shm
volumes:
  {{- include "dmuond.volumes" . | nindent 2 }}
{{- end -}}


{{/*
Scrape settings of the ServiceMonitor and PodMonitor endpoints for a
protected metrics port: scheme, tlsConfig (metrics.tls) and authorization
(metrics.auth).
*/}}
{{- define "dmuond.scrapeSecurity" -}}
{{- $m := .Values.metrics -}}
{{- if $m.tls }}
scheme: https
{{- $tc := deepCopy (default dict $m.scrape.tlsConfig) -}}
{{- if not (or (hasKey $tc "ca") (hasKey $tc "caFile")) -}}
{{- $_ := set $tc "ca" (dict "secret" (dict "name" .Values.tls.secretName "key" "ca.crt")) -}}
{{- end }}
tlsConfig:
  {{- toYaml $tc | nindent 2 }}
{{- else }}
scheme: http
{{- end }}
{{- if $m.auth }}
authorization:
  type: Bearer
  credentials:
    name: {{ $m.scrape.tokenSecret.name }}
    key: {{ $m.scrape.tokenSecret.key }}
{{- end }}
{{- end -}}
