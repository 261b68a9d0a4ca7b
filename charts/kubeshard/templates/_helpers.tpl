{{/* Names and labels of every object of the chart: the one place that spells them. */}}

{{- define "kubeshard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-kubeshard, or just <release> when it already says kubeshard. Kept short:
     "-operator"/"-router"/"-redis" and pod suffixes are appended. */}}
{{- define "kubeshard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kubeshard.operator.fullname" -}}{{ include "kubeshard.fullname" . }}-operator{{- end -}}
{{- define "kubeshard.router.fullname" -}}{{ include "kubeshard.fullname" . }}-router{{- end -}}
{{- define "kubeshard.redis.fullname" -}}{{ include "kubeshard.fullname" . }}-redis{{- end -}}
{{- define "kubeshard.metrics.fullname" -}}{{ include "kubeshard.fullname" . }}-metrics{{- end -}}
{{- define "kubeshard.loadToken.secret" -}}{{ include "kubeshard.fullname" . }}-load-token{{- end -}}

{{/* The volume and mount of the load token (the routers' GET /internal/load). */}}
{{- define "kubeshard.loadToken.volume" -}}
- name: load-token
  secret:
    secretName: {{ include "kubeshard.loadToken.secret" . }}
{{- end -}}
{{- define "kubeshard.loadToken.mount" -}}
- name: load-token
  mountPath: /etc/kubeshard/load-token
  readOnly: true
{{- end -}}
{{- define "kubeshard.loadToken.file" -}}/etc/kubeshard/load-token/token{{- end -}}

{{- define "kubeshard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kubeshard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubeshard
{{- end -}}

{{/* Selector labels of one component: stable across upgrades (selectors are immutable). */}}
{{- define "kubeshard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubeshard.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kubeshard.image" -}}
{{- $tag := default .root.Chart.AppVersion .image.tag -}}
{{- printf "%s:%s%s" .image.repository $tag (default "" .suffix) -}}
{{- end -}}

{{/* Where the router and the operator find Redis: "" when there is none. */}}
{{- define "kubeshard.redis.internalUrl" -}}
{{- if and .Values.redis.enabled (not .Values.redis.external.url) -}}
{{- printf "redis://%s.%s.svc:6379/0" (include "kubeshard.redis.fullname" .) .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- define "kubeshard.redis.used" -}}
{{- if or .Values.redis.external.url .Values.redis.enabled -}}true{{- end -}}
{{- end -}}

{{/* KUBESHARD_REDIS_URL: a literal for the chart's own Redis (no password), a Secret
     reference for an external one (its URL may carry a password). */}}
{{- define "kubeshard.redis.env" -}}
{{- if .Values.redis.external.url }}
- name: KUBESHARD_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "kubeshard.redis.fullname" . }}-url
      key: url
{{- else if .Values.redis.enabled }}
- name: KUBESHARD_REDIS_URL
  value: {{ include "kubeshard.redis.internalUrl" . | quote }}
{{- end }}
{{- end -}}

{{- define "kubeshard.routerUrl" -}}
{{- printf "http://%s.%s.svc:%v" (include "kubeshard.router.fullname" .) .Release.Namespace .Values.router.service.port -}}
{{- end -}}

{{- define "kubeshard.shardNamespaces" -}}
{{- if .Values.networkPolicy.shardNamespaces -}}
{{- toJson .Values.networkPolicy.shardNamespaces -}}
{{- else if .Values.watchNamespace -}}
{{- toJson (list .Values.watchNamespace) -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}
