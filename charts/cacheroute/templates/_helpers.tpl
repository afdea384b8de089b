{{/*
Names, labels and the values every component must agree on. Templates never spell a
Secret name, a port or a DNS name themselves: they include one of these, so the gateway,
the indexer and the replicas cannot drift apart.
*/}}

{{- define "cacheroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cacheroute.fullname" -}}
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

{{- define "cacheroute.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries. */}}
{{- define "cacheroute.labels" -}}
helm.sh/chart: {{ include "cacheroute.chart" . }}
app.kubernetes.io/name: {{ include "cacheroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cacheroute
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "cacheroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cacheroute.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component's objects: call like selectorLabels. */}}
{{- define "cacheroute.componentLabels" -}}
{{ include "cacheroute.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "cacheroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "cacheroute.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Pod template labels of one component: every label the component's objects carry
(commonLabels and app.kubernetes.io/* included), so pods are found by the same labels
as their workload; the selector stays the selector labels alone. Call like selectorLabels.
*/}}
{{- define "cacheroute.podLabels" -}}
{{ include "cacheroute.componentLabels" . }}
{{- end }}

{{/*
An image reference: repository, then `:tag` when a tag is set, then `@digest` when a
digest is set (the digest pins the image; the tag is then only for people reading it).
Call with (dict "image" .Values.x.image "key" "x.image" "defaultTag" TAG).
*/}}
{{- define "cacheroute.image" -}}
{{- $tag := default .defaultTag .image.tag }}
{{- if not (or $tag .image.digest) }}
{{- fail (printf "%s: set a tag or a digest" .key) }}
{{- end }}
{{- .image.repository }}{{ with $tag }}:{{ . }}{{ end }}{{ with .image.digest }}@{{ . }}{{ end }}
{{- end }}

{{- define "cacheroute.gatewayImage" -}}
{{- include "cacheroute.image" (dict "image" .Values.gateway.image "key" "gateway.image" "defaultTag" .Chart.AppVersion) }}
{{- end }}

{{/* ------------------------------------------------------------ object names */}}

{{- define "cacheroute.gateway.fullname" -}}
{{- printf "%s-gateway" (include "cacheroute.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cacheroute.indexer.fullname" -}}
{{- printf "%s-indexer" (include "cacheroute.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cacheroute.redis.fullname" -}}
{{- printf "%s-redis" (include "cacheroute.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cacheroute.vllm.fullname" -}}
{{- printf "%s-vllm" (include "cacheroute.fullname" .) | trunc 52 | trimSuffix "-" }}
{{- end }}

{{/* The headless Service the replicas' pod names live under; the gateway and the indexer
both resolve it, so they see the same fleet. */}}
{{- define "cacheroute.vllm.headless" -}}
{{- printf "%s-headless" (include "cacheroute.vllm.fullname" .) }}
{{- end }}

{{/* The headless Service's DNS name. */}}
{{- define "cacheroute.vllm.serviceHost" -}}
{{- printf "%s.%s.svc.%s" (include "cacheroute.vllm.headless" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/* One replica pod's stable DNS name: call with (dict "ctx" $ "ordinal" N). */}}
{{- define "cacheroute.vllm.podHost" -}}
{{- printf "%s-%d.%s" (include "cacheroute.vllm.fullname" .ctx) (int .ordinal) (include "cacheroute.vllm.serviceHost" .ctx) }}
{{- end }}

{{- define "cacheroute.config.fullname" -}}
{{- printf "%s-config" (include "cacheroute.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The model volume's source: modelStorage.volume when set, else the claim. */}}
{{- define "cacheroute.modelVolume" -}}
{{- if .Values.modelStorage.volume }}
{{- toYaml .Values.modelStorage.volume }}
{{- else }}
persistentVolumeClaim:
  claimName: {{ required "modelStorage.existingClaim or modelStorage.volume is required" .Values.modelStorage.existingClaim }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "cacheroute.modelDir" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.modelStorage.mountPath) .Values.model.path }}
{{- end }}

{{/* ------------------------------------------------------------- secrets */}}

{{/* The hash seed: the Secret and key that the replicas' PYTHONHASHSEED and the gateway's
hash_seed both read. */}}
{{- define "cacheroute.seed.secretName" -}}
{{- default (printf "%s-hash-seed" (include "cacheroute.fullname" .)) .Values.cache.hashSeed.existingSecret }}
{{- end }}

{{- define "cacheroute.tenants.secretName" -}}
{{- printf "%s-tenants" (include "cacheroute.fullname" .) }}
{{- end }}

{{- define "cacheroute.salt.secretName" -}}
{{- default (include "cacheroute.tenants.secretName" .) .Values.tenants.saltSecret.existingSecret }}
{{- end }}

{{/* The environment variable holding one API key: CACHEROUTE_API_KEY_<NAME>. */}}
{{- define "cacheroute.apiKeyEnv" -}}
{{- printf "CACHEROUTE_API_KEY_%s" (upper .name) }}
{{- end }}

{{/* The Secret key holding one API key in the chart's tenants Secret. */}}
{{- define "cacheroute.apiKeySecretKey" -}}
{{- printf "api-key-%s" .name }}
{{- end }}

{{/*
A value kept in a Secret across upgrades: the given one, else what the Secret already
holds (lookup; empty under `helm template`), else a fresh one from `generate`. With
secrets.requireExisting a fresh one is refused: `helm template` and GitOps tools such as
Argo CD render without a cluster, so every render would rotate the value.
Call with (dict "ctx" $ "secret" NAME "key" KEY "given" VALUE "generate" FRESH
"value" VALUES_PATH "existing" EXISTING_SECRET_PATH).
*/}}
{{- define "cacheroute.keptValue" -}}
{{- if .given }}
{{- .given }}
{{- else }}
{{- $existing := lookup "v1" "Secret" .ctx.Release.Namespace .secret }}
{{- if and $existing (hasKey ($existing.data | default dict) .key) }}
{{- index $existing.data .key | b64dec }}
{{- else if .ctx.Values.secrets.requireExisting }}
{{- fail (printf "secrets.requireExisting: Secret %s (key %s) is not in the cluster, or lookup cannot see one (helm template, Argo CD): set %s to a Secret you manage, or give %s" .secret .key .existing .value) }}
{{- else }}
{{- .generate }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A checksum of the hash seed's definition, on every pod that reads the seed (replicas,
gateways, indexer): changing it rolls all of them together, so none keeps an old seed.
*/}}
{{- define "cacheroute.seedChecksum" -}}
{{- toJson .Values.cache.hashSeed | sha256sum }}
{{- end }}

{{/* --------------------------------------------------------------- redis */}}

{{- define "cacheroute.redis.url" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s.%s.svc.%s:%d/0" (include "cacheroute.redis.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.redis.port) }}
{{- else }}
{{- required "redis.external.url is required when redis.enabled is false" .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/* The Secret and key holding the Redis password; empty name when there is none. */}}
{{- define "cacheroute.redis.passwordSecretName" -}}
{{- if .Values.redis.enabled }}
{{- if .Values.redis.auth.enabled }}
{{- default (include "cacheroute.redis.fullname" .) .Values.redis.auth.existingSecret }}
{{- end }}
{{- else }}
{{- .Values.redis.external.existingSecret }}
{{- end }}
{{- end }}

{{- define "cacheroute.redis.passwordSecretKey" -}}
{{- if .Values.redis.enabled }}{{ .Values.redis.auth.secretKey }}{{ else }}{{ .Values.redis.external.secretKey }}{{ end }}
{{- end }}

{{/* ------------------------------------------------------- gateway config */}}

{{/*
The gateway's config (router/config.py), as a dict. The seed, the API keys, the salt
secret and the Redis password never appear here: the config names environment variables
that the pods fill from Secrets.
*/}}
{{- define "cacheroute.gatewayConfig" -}}
{{- $vllm := .Values.vllm }}
{{- $common := dict
  "models" (list .Values.model.name)
  "block_size" (int .Values.cache.blockSize)
  "hash_algo" .Values.cache.hashAlgo
}}
{{- $replicas := list }}
{{- if eq $vllm.discovery "dns" }}
{{- $replicas = append $replicas (merge (dict
  "name" (include "cacheroute.vllm.fullname" .)
  "dns" (printf "%s:%d" (include "cacheroute.vllm.serviceHost" .) (int $vllm.port))
  "kv_events" (printf "tcp://{host}:%d" (int $vllm.kvEvents.port))
  "kv_replay" (printf "tcp://{host}:%d" (int $vllm.kvEvents.replayPort))
) $common) }}
{{- else }}
{{- range $i := until (int $vllm.replicaCount) }}
{{- $host := include "cacheroute.vllm.podHost" (dict "ctx" $ "ordinal" $i) }}
{{- $replicas = append $replicas (merge (dict
  "name" (printf "%s-%d" (include "cacheroute.vllm.fullname" $) $i)
  "url" (printf "http://%s:%d" $host (int $vllm.port))
  "kv_events" (printf "tcp://%s:%d" $host (int $vllm.kvEvents.port))
  "kv_replay" (printf "tcp://%s:%d" $host (int $vllm.kvEvents.replayPort))
) (deepCopy $common)) }}
{{- end }}
{{- end }}
{{- $model := dict "tokenizer" (include "cacheroute.modelDir" .) }}
{{- if gt (int $vllm.maxModelLen) 0 }}
{{- $_ := set $model "max_model_len" (int $vllm.maxModelLen) }}
{{- end }}
{{- $index := dict "backend" (include "cacheroute.redis.url" .) "deadline_ms" .Values.gateway.index.deadlineMs "share_segments" .Values.gateway.index.shareSegments "segment_ttl_s" .Values.gateway.index.segmentTtlSeconds "mirror_events" .Values.gateway.index.mirrorEvents }}
{{- if include "cacheroute.redis.passwordSecretName" . }}
{{- $_ := set $index "password_env" "CACHEROUTE_REDIS_PASSWORD" }}
{{- end }}
{{- $keys := list }}
{{- range .Values.tenants.apiKeys }}
{{- $key := dict "key_env" (include "cacheroute.apiKeyEnv" .) "tenant" .tenant "salted" (ternary .salted true (hasKey . "salted")) }}
{{- if .allowClientSalt }}
{{- $_ := set $key "allow_client_salt" .allowClientSalt }}
{{- end }}
{{- $keys = append $keys $key }}
{{- end }}
{{- $config := dict
  "listen" (dict "host" "0.0.0.0" "port" (int .Values.gateway.port))
  "models" (dict .Values.model.name $model)
  "replicas" $replicas
  "index" $index
  "policy" (dict "name" .Values.gateway.policy.name "weights" .Values.gateway.policy.weights "share_work" .Values.gateway.policy.shareWork)
  "tenants" (dict "secret_env" "CACHEROUTE_SALT_SECRET" "allow_anonymous" .Values.tenants.allowAnonymous "keys" $keys)
}}
{{- $merged := mergeOverwrite $config (deepCopy .Values.gateway.config) }}
{{- toYaml $merged }}
{{- end }}

{{/*
The indexer's config: the same replicas and index sections as the gateway's (taken from
the one rendered config), and nothing else, so the indexer needs neither the tokenizer
files nor the API keys.
*/}}
{{- define "cacheroute.indexerConfig" -}}
{{- $gateway := include "cacheroute.gatewayConfig" . | fromYaml }}
{{- toYaml (dict "replicas" $gateway.replicas "index" $gateway.index) }}
{{- end }}

{{/* Environment shared by the gateway and the indexer: the seed and the Redis password. */}}
{{- define "cacheroute.sharedEnv" -}}
{{- $entries := ternary 1 (int .Values.vllm.replicaCount) (eq .Values.vllm.discovery "dns") }}
{{- range $i := until $entries }}
# The replicas' PYTHONHASHSEED, from the same Secret key they read: replicas[{{ $i }}].hash_seed.
- name: CACHEROUTE_REPLICAS__{{ $i }}__HASH_SEED
  valueFrom:
    secretKeyRef:
      name: {{ include "cacheroute.seed.secretName" $ }}
      key: {{ $.Values.cache.hashSeed.secretKey }}
{{- end }}
{{- with include "cacheroute.redis.passwordSecretName" . }}
- name: CACHEROUTE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ include "cacheroute.redis.passwordSecretKey" $ }}
{{- end }}
- name: HOME
  value: /tmp
{{- end }}
