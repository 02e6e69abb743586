{{/* Names, labels and the values every process shares. */}}

{{- define "cd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "cd.fullname" -}}
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

{{/* Cluster-scoped objects carry the namespace too, so two releases never collide. */}}
{{- define "cd.clusterName" -}}
{{- printf "%s-%s-%s" (include "cd.fullname" .root) .root.Release.Namespace .suffix | trunc 253 -}}
{{- end -}}

{{- define "cd.labels" -}}
app.kubernetes.io/name: {{ include "cd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: compute-domain
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "cd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cd.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "cd.controllerServiceAccount" -}}{{ include "cd.fullname" . }}-controller{{- end -}}
{{- define "cd.kubeletPluginServiceAccount" -}}{{ include "cd.fullname" . }}-kubelet-plugin{{- end -}}
{{/* Fixed: the controller puts this name into every daemon pod it creates. */}}
{{- define "cd.daemonServiceAccount" -}}compute-domain-daemon-service-account{{- end -}}

{{- define "cd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "cd.hostManaged" -}}
{{- if eq (toString .Values.resources.computeDomains.imex.mode) "hostManaged" -}}true{{- end -}}
{{- end -}}

{{/* The namespaces the controller manages: the release namespace, then additionalNamespaces. */}}
{{- define "cd.managedNamespaces" -}}
{{- $all := list .Release.Namespace -}}
{{- range .Values.additionalNamespaces -}}
{{- if not (has . $all) -}}{{- $all = append $all . -}}{{- end -}}
{{- end -}}
{{- toJson $all -}}
{{- end -}}

{{/* FEATURE_GATES: the featureGates map as "Name=bool," pairs in key order (trailing comma, as the
     reference renders it; the processes ignore empty items). */}}
{{- define "cd.featureGates" -}}
{{- range $name, $value := .Values.featureGates -}}
{{- printf "%s=%s," $name (lower (toString $value)) -}}
{{- end -}}
{{- end -}}

{{/* Env shared by the controller and the node agent (computedomain/settings.py CommonSettings). */}}
{{- define "cd.commonEnv" -}}
- name: FEATURE_GATES
  value: {{ include "cd.featureGates" . | quote }}
- name: IMEX_MODE
  value: {{ .Values.resources.computeDomains.imex.mode | toString | quote }}
- name: IMEX_ISOLATION
  value: {{ .Values.resources.computeDomains.imex.isolation | toString | quote }}
- name: IMEX_HOST_SOCKET_PATH
  value: {{ .Values.resources.computeDomains.imex.hostSocketPath | toString | quote }}
- name: NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: KUBECONFIG
  value: {{ .Values.kubeconfig | toString | quote }}
- name: LOG_LEVEL
  value: {{ .Values.logLevel | toString | quote }}
- name: LOG_FORMAT
  value: {{ .Values.logFormat | toString | quote }}
{{- end -}}
