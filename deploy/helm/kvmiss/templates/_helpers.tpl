{{- define "kvmiss.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvmiss.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvmiss.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride }}
{{- end }}

{{- define "kvmiss.headlessName" -}}
{{- printf "%s-headless" (include "kvmiss.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvmiss.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvmiss.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvmiss.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvmiss.labels" -}}
helm.sh/chart: {{ include "kvmiss.chart" . }}
{{ include "kvmiss.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.additionalLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvmiss.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvmiss.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvmiss.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "kvmiss.secretName" -}}
{{- default (printf "%s-digest-key" (include "kvmiss.fullname" .)) .Values.digestKey.existingSecret }}
{{- end }}

{{- define "kvmiss.fleetFile" -}}/var/run/kvmiss/fleet/fleet.toml{{- end }}

{{- define "kvmiss.slicesNamespace" -}}
{{- default (include "kvmiss.namespace" .) .Values.fleet.endpointSlices.namespace }}
{{- end }}

{{/*
The configuration as a dict: .Values.config with what the chart owns set over it. Fails on a
digest key in the config (it belongs in the Secret) and on a fleet the mode cannot serve.
*/}}
{{- define "kvmiss.configDict" -}}
{{- $cfg := deepCopy (default dict .Values.config) }}
{{- $privacy := default dict (get $cfg "privacy") }}
{{- if get $privacy "digest_key" }}
{{- fail "config.privacy.digest_key: the digest key goes in a Secret (digestKey.existingSecret or digestKey.value), never in the ConfigMap" }}
{{- end }}
{{- $_ := set $cfg "privacy" (dict "digest_key_env" "KVMISS_DIGEST_KEY") }}
{{- $host := .Values.listenHost }}
{{- $otlp := default dict (get $cfg "otlp") }}
{{- $ports := .Values.ports }}
{{- if (index $ports "otlp").enabled }}
{{- $_ := set $otlp "grpc" (printf "%s:%v" $host (index $ports "otlp").containerPort) }}
{{- else }}
{{- $_ := set $otlp "grpc" "" }}
{{- end }}
{{- if (index $ports "otlp-http").enabled }}
{{- $_ := set $otlp "http" (printf "%s:%v" $host (index $ports "otlp-http").containerPort) }}
{{- else }}
{{- $_ := set $otlp "http" "" }}
{{- end }}
{{- $_ := set $cfg "otlp" $otlp }}
{{- $metrics := default dict (get $cfg "metrics") }}
{{- $_ := set $metrics "listen" (printf "%s:%v" $host (index $ports "metrics").containerPort) }}
{{- $_ := set $cfg "metrics" $metrics }}
{{- $fleet := default dict (get $cfg "fleet") }}
{{- $mode := .Values.fleet.mode }}
{{- $workers := default list .Values.fleet.workers }}
{{- if $workers }}
{{- $_ := set $cfg "workers" $workers }}
{{- end }}
{{- if eq $mode "static" }}
{{- if not $workers }}
{{- fail "fleet.mode static: list the engines in fleet.workers (or choose mode dns, topics or endpointslices)" }}
{{- end }}
{{- else if eq $mode "dns" }}
{{- $_ := set $fleet "dns" .Values.fleet.dns }}
{{- else if eq $mode "topics" }}
{{- if gt (int .Values.replicaCount) 1 }}
{{- fail "fleet.mode topics: replicaCount must be 1 (each engine's PUB connects to one address, and every replica must hear every engine)" }}
{{- end }}
{{- $topics := deepCopy .Values.fleet.topics }}
{{- $_ := set $topics "bind" (printf "tcp://*:%v" (index $ports "kv-events").containerPort) }}
{{- $_ := set $fleet "topics" $topics }}
{{- else if eq $mode "endpointslices" }}
{{- $_ := set $fleet "file" (include "kvmiss.fleetFile" .) }}
{{- else }}
{{- fail (printf "fleet.mode: %q is not one of static, dns, topics, endpointslices" $mode) }}
{{- end }}
{{- $_ := set $cfg "fleet" $fleet }}
{{- toJson $cfg }}
{{- end }}

{{/*
TOML from a dict: its scalars and arrays first, then each table ([a.b]) and array of tables
([[a]]), keys in sorted order; null values are left out. Whole numbers are written as integers
(Helm reads every YAML number as a float), which kvmiss also takes for a float key.
*/}}
{{- define "kvmiss.tomlValue" -}}
{{- if kindIs "string" . }}{{ toJson . }}
{{- else if kindIs "bool" . }}{{ ternary "true" "false" . }}
{{- else if kindIs "float64" . }}{{ if eq (floor .) . }}{{ int64 . }}{{ else }}{{ toJson . }}{{ end }}
{{- else if or (kindIs "int" .) (kindIs "int64" .) }}{{ . }}
{{- else if kindIs "slice" . }}[{{ range $i, $v := . }}{{ if $i }}, {{ end }}{{ include "kvmiss.tomlValue" $v }}{{ end }}]
{{- else }}{{ fail (printf "config: cannot write %v (%s) as TOML" . (kindOf .)) }}
{{- end }}
{{- end }}

{{- define "kvmiss.tomlTable" -}}
{{- $path := .path }}
{{- $table := .table }}
{{- range $key, $value := $table }}
{{- if and (not (kindIs "invalid" $value)) (not (kindIs "map" $value)) (not (and (kindIs "slice" $value) $value (kindIs "map" (first $value)))) }}
{{ $key }} = {{ include "kvmiss.tomlValue" $value }}
{{- end }}
{{- end }}
{{- range $key, $value := $table }}
{{- $sub := ternary $key (printf "%s.%s" $path $key) (eq $path "") }}
{{- if kindIs "map" $value }}

[{{ $sub }}]
{{- include "kvmiss.tomlTable" (dict "path" $sub "table" $value) }}
{{- else if and (kindIs "slice" $value) $value (kindIs "map" (first $value)) }}
{{- range $value }}

[[{{ $sub }}]]
{{- include "kvmiss.tomlTable" (dict "path" $sub "table" .) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvmiss.toml" -}}
# kvmiss.toml, rendered by the kvmiss Helm chart from its values (every key: examples/kvmiss.toml).
{{- include "kvmiss.tomlTable" (dict "path" "" "table" (include "kvmiss.configDict" . | fromJson)) }}
{{ end }}
