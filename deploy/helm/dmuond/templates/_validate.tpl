{{/*
Template-time checks of combinations values.schema.json cannot express (and
of enums again, for `--skip-schema-validation`). Each message names the keys
to change. Rendered once, from validate.yaml.
*/}}
{{- define "dmuond.validate" -}}
{{- $v := .Values -}}
{{- $d := $v.daemon -}}
{{- $sidecar := eq $v.mode "sidecar" -}}

{{- if not (has $v.mode (list "daemonset" "sidecar")) -}}
{{- fail (printf "mode must be daemonset or sidecar, got %q" (toString $v.mode)) -}}
{{- end -}}
{{- if not (has $d.logFormat (list "text" "json")) -}}
{{- fail (printf "daemon.logFormat must be text or json, got %q" (toString $d.logFormat)) -}}
{{- end -}}
{{- if not (has $d.nanPolicy (list "skip" "fail")) -}}
{{- fail (printf "daemon.nanPolicy must be skip or fail, got %q" (toString $d.nanPolicy)) -}}
{{- end -}}
{{- if not (regexMatch "^(auto|cpu|cuda:[0-9]+(,[0-9]+)*)$" (toString $d.devices)) -}}
{{- fail (printf "daemon.devices must be auto, cpu or cuda:<i>[,<j>...], got %q" (toString $d.devices)) -}}
{{- end -}}

{{- /* Ports. */ -}}
{{- if and $v.metrics.enabled (eq (int $v.ports.metrics) (int $v.ports.grpc)) -}}
{{- fail (printf "ports.metrics (%d) must differ from ports.grpc (%d): dmuond serves gRPC and /metrics on separate listeners (or set metrics.enabled=false)" (int $v.ports.metrics) (int $v.ports.grpc)) -}}
{{- end -}}
{{- if and (eq $v.probes.type "grpc") (has $d.listenHost (list "127.0.0.1" "localhost" "::1" "[::1]")) -}}
{{- fail (printf "daemon.listenHost=%s with probes.type=grpc: the kubelet's gRPC probes dial the pod IP, so listen on 0.0.0.0 (or ::), or use probes.type=exec" $d.listenHost) -}}
{{- end -}}

{{- /* Devices against the GPUs the container is given. */ -}}
{{- $gpus := int $v.gpu.count -}}
{{- if and (eq $d.devices "cpu") (gt $gpus 0) -}}
{{- fail (printf "daemon.devices=cpu with gpu.count=%d: the GPUs would be reserved and never used; set gpu.count=0 or daemon.devices=auto" $gpus) -}}
{{- end -}}
{{- if hasPrefix "cuda:" $d.devices -}}
{{- if and (eq $gpus 0) (not $v.gpu.claims) -}}
{{- fail (printf "daemon.devices=%s but gpu.count=0: the container would see no GPU; set gpu.count (or gpu.claims)" $d.devices) -}}
{{- end -}}
{{- if gt $gpus 0 -}}
{{- range (trimPrefix "cuda:" $d.devices | splitList ",") -}}
{{- if ge (atoi .) $gpus -}}
{{- fail (printf "daemon.devices=%s names GPU %s but the container is given gpu.count=%d GPU(s), indices 0..%d" $d.devices . $gpus (sub $gpus 1)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $k, $_ := (default dict (default dict $v.resources).limits) -}}
{{- if eq $k $v.gpu.resourceName -}}
{{- fail (printf "resources.limits sets %s: set gpu.count instead (the chart adds the limit)" $k) -}}
{{- end -}}
{{- end -}}

{{- /* State. */ -}}
{{- if $v.state.enabled -}}
{{- $hasHost := ne (toString $v.state.hostPath) "" -}}
{{- $hasVol := not (empty $v.state.volume) -}}
{{- if and (not $hasHost) (not $hasVol) -}}
{{- fail "state.enabled=true needs a volume for state.mountPath: set state.hostPath (a node directory) or state.volume (e.g. {persistentVolumeClaim: {claimName: ...}})" -}}
{{- end -}}
{{- if and $hasHost $hasVol -}}
{{- fail "state.hostPath and state.volume are both set: choose one" -}}
{{- end -}}
{{- end -}}
{{- if and (not $v.state.enabled) (gt (int $v.state.snapshotEvery) 0) -}}
{{- fail "state.snapshotEvery is set but state.enabled=false: snapshots need a state directory" -}}
{{- end -}}

{{- /* Shutdown: the kubelet must wait for the drain. */ -}}
{{- if le (int $v.terminationGracePeriodSeconds) (int $d.exitTimeoutSecs) -}}
{{- fail (printf "terminationGracePeriodSeconds (%d) must exceed daemon.exitTimeoutSecs (%d), or the kubelet kills dmuond before it drains and snapshots" (int $v.terminationGracePeriodSeconds) (int $d.exitTimeoutSecs)) -}}
{{- end -}}

{{- /* TLS. */ -}}
{{- if $v.tls.enabled -}}
{{- $_ := required "tls.secretName is required when tls.enabled=true (a kubernetes.io/tls Secret with tls.crt and tls.key)" $v.tls.secretName -}}
{{- if eq $v.probes.type "grpc" -}}
{{- fail "tls.enabled=true with probes.type=grpc: the kubelet's native gRPC probes cannot speak TLS; set probes.type=exec (dmuonctl health) and its TLS flags in probes.execArgs" -}}
{{- end -}}
{{- end -}}
{{- if and $v.tls.clientCA (not $v.tls.enabled) -}}
{{- fail "tls.clientCA=true needs tls.enabled=true (mTLS is TLS)" -}}
{{- end -}}
{{- if $v.auth.enabled -}}
{{- $_ := required "auth.secretName is required when auth.enabled=true (a Secret whose auth.key holds the '<role> <token> [name]' lines)" $v.auth.secretName -}}
{{- end -}}

{{- /* Metrics port protection. */ -}}
{{- if $v.metrics.tls -}}
{{- if not $v.metrics.enabled -}}
{{- fail "metrics.tls=true needs metrics.enabled=true (there is no metrics port to protect)" -}}
{{- end -}}
{{- if not $v.tls.enabled -}}
{{- fail "metrics.tls=true needs tls.enabled=true: --metrics-tls serves the daemon's --tls-cert-file/--tls-key-file, which come from tls.secretName" -}}
{{- end -}}
{{- end -}}
{{- if $v.metrics.auth -}}
{{- if not $v.metrics.enabled -}}
{{- fail "metrics.auth=true needs metrics.enabled=true (there is no metrics port to protect)" -}}
{{- end -}}
{{- if not $v.auth.enabled -}}
{{- fail "metrics.auth=true needs auth.enabled=true: --metrics-auth checks bearer tokens against --auth-token-file, which comes from auth.secretName" -}}
{{- end -}}
{{- if and (or $v.metrics.serviceMonitor.enabled $v.metrics.podMonitor.enabled) (not $v.metrics.scrape.tokenSecret.name) -}}
{{- fail "metrics.auth=true with a ServiceMonitor/PodMonitor needs metrics.scrape.tokenSecret.name (a Secret in the monitor's namespace whose metrics.scrape.tokenSecret.key holds a token of the auth file, e.g. a reader's): Prometheus would get 401" -}}
{{- end -}}
{{- end -}}

{{- /* Monitoring. */ -}}
{{- if $v.metrics.serviceMonitor.enabled -}}
{{- if not $v.metrics.enabled -}}
{{- fail "metrics.serviceMonitor.enabled=true needs metrics.enabled=true (the daemon would run with --metrics-port=0)" -}}
{{- end -}}
{{- if $sidecar -}}
{{- fail "metrics.serviceMonitor needs the DaemonSet's Service; in sidecar mode use metrics.podMonitor" -}}
{{- end -}}
{{- if not $v.service.enabled -}}
{{- fail "metrics.serviceMonitor.enabled=true needs service.enabled=true (a ServiceMonitor selects a Service)" -}}
{{- end -}}
{{- end -}}
{{- if and $v.metrics.podMonitor.enabled (not $v.metrics.enabled) -}}
{{- fail "metrics.podMonitor.enabled=true needs metrics.enabled=true (the daemon would run with --metrics-port=0)" -}}
{{- end -}}

{{- /* Disruption budget. */ -}}
{{- $pdb := $v.podDisruptionBudget -}}
{{- if $pdb.enabled -}}
{{- if $sidecar -}}
{{- fail "podDisruptionBudget is for the DaemonSet; in sidecar mode the trainer's controller owns disruptions" -}}
{{- end -}}
{{- $hasMax := not (kindIs "invalid" (index $pdb "maxUnavailable")) -}}
{{- $hasMin := not (kindIs "invalid" (index $pdb "minAvailable")) -}}
{{- if and $hasMax $hasMin -}}
{{- fail "podDisruptionBudget: set exactly one of maxUnavailable and minAvailable (to use minAvailable, set maxUnavailable: null)" -}}
{{- end -}}
{{- if not (or $hasMax $hasMin) -}}
{{- fail "podDisruptionBudget: set one of maxUnavailable and minAvailable" -}}
{{- end -}}
{{- end -}}

{{- /* Flags the chart owns cannot be passed again. */ -}}
{{- $owned := list "--listen" "--devices" "--cpu-threads" "--cpu-executors" "--max-batch" "--summary-every-secs" "--metrics-port" "--metrics-tls" "--metrics-auth" "--state-dir" "--snapshot-every" "--max-sessions" "--max-message-bytes" "--exit-timeout-secs" "--job-retention-seconds" "--max-world-size" "--max-job-parameters" "--max-job-elements" "--max-state-bytes" "--max-ns-steps" "--max-job-id-bytes" "--max-idle-jobs" "--attach-timeout-seconds" "--max-step-queue-bytes" "--nan-policy" "--log-level" "--log-format" -}}
{{- range $d.extraArgs -}}
{{- $flag := regexReplaceAll "^(-{1,2}[^=]+).*$" . "${1}" | replace "_" "-" -}}
{{- $flag = regexReplaceAll "^-([^-])" $flag "--${1}" -}}
{{- if has $flag $owned -}}
{{- fail (printf "daemon.extraArgs sets %s, which the chart manages from values (see values.yaml: daemon, ports, metrics, state)" $flag) -}}
{{- end -}}
{{- end -}}
{{- end -}}
