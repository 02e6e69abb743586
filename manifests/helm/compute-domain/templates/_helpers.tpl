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

{{/* The NVIDIA driver root as the host has it: nvidiaDriverRoot, or kubeletPlugin.nvidiaDriverRoot, its older
     name (cd.validate refuses the two set to different roots). */}}
{{- define "cd.driverRoot" -}}
{{- with .Values.kubeletPlugin.nvidiaDriverRoot -}}{{ toString . }}{{- else -}}{{ toString (default "/" .Values.nvidiaDriverRoot) }}{{- end -}}
{{- end -}}

{{/* A container's env list: the chart's entries (.chart, YAML text) with the operator's (.user, EnvVar
     objects) appended; an operator entry replaces the chart's of the same name, so every name appears once
     (a duplicate would make the apiserver warn and a later upgrade's patch fail). A value given as a number
     or boolean (`--set ...value=7`) becomes its text: EnvVar values are strings. */}}
{{- define "cd.env" -}}
{{- $names := dict -}}
{{- $user := list -}}
{{- range .user | default list -}}
{{- $item := deepCopy . -}}
{{- if hasKey $item "value" -}}{{- $_ := set $item "value" (ternary "" (toString $item.value) (kindIs "invalid" $item.value)) -}}{{- end -}}
{{- $_ := set $names (toString $item.name) true -}}
{{- $user = append $user $item -}}
{{- end -}}
{{- $out := list -}}
{{- range fromYamlArray .chart -}}
{{- if not (hasKey $names .name) -}}{{- $out = append $out . -}}{{- end -}}
{{- end -}}
{{- toYaml (concat $out $user) -}}
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
