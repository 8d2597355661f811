{{- define "pelican.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pelican.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pelican.labels" -}}
app.kubernetes.io/name: {{ include "pelican.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: pelican
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pelican.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pelican.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pelican.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pelican.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The host:port a listener binds: listenAddress and the port given, an IPv6 address in brackets. */}}
{{- define "pelican.listen" -}}
{{- $host := .root.Values.listenAddress | default "0.0.0.0" -}}
{{- if contains ":" $host -}}[{{ $host }}]:{{ .port }}{{- else -}}{{ $host }}:{{ .port }}{{- end -}}
{{- end -}}
