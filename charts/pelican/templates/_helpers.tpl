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

{{/* The operator image: the chart's appVersion unless image.tag names another, which runs only when image.tagFor
     says it was set for this appVersion. The chart passes its own version's flags; an older binary exits on them. */}}
{{- define "pelican.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if and (ne $tag .Chart.AppVersion) (ne .Values.image.tagFor .Chart.AppVersion) -}}
{{- fail (printf "image.tag is %q, but this chart runs Pelican %s with flags an older operator does not know. A tag kept from an earlier release (helm upgrade --reset-then-reuse-values keeps what you set) is the usual cause: add --set image.tag= to run %s, or --set image.tag=%s --set image.tagFor=%s if that image is a build of %s" $tag .Chart.AppVersion .Chart.AppVersion $tag .Chart.AppVersion .Chart.AppVersion) -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
