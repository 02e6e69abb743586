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

{{/* The namespace of every namespaced object: namespaceOverride, else the release namespace. */}}
{{- define "cd.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{/* Cluster-scoped objects carry the namespace too, so two releases never collide. */}}
{{- define "cd.clusterName" -}}
{{- printf "%s-%s-%s" (include "cd.fullname" .root) (include "cd.namespace" .root) .suffix | trunc 253 -}}
{{- end -}}

{{/* The reference chart's name for what it names after itself (its pod label key and its Lease):
     nameOverride, else its chart name. */}}
{{- define "cd.referenceName" -}}
{{- default "dra-driver-nvidia-gpu" .Values.nameOverride -}}
{{- end -}}

{{- define "cd.labels" -}}
app.kubernetes.io/name: {{ include "cd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: compute-domain
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of a component's pods: selectorLabelsOverride (the reference's key) or the chart's
     name and instance, plus the component (so the two workloads never select each other's pods). */}}
{{- define "cd.selectorLabels" -}}
{{- with .root.Values.selectorLabelsOverride -}}
{{ toYaml . }}
{{- else -}}
app.kubernetes.io/name: {{ include "cd.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Pod labels: the selector labels and the reference's component label, which its users' dashboards,
     scripts and affinity rules select by (dra-driver-nvidia-gpu-component: controller|kubelet-plugin). */}}
{{- define "cd.podLabels" -}}
{{ include "cd.selectorLabels" . }}
{{ include "cd.referenceName" .root }}-component: {{ .component }}
{{- end -}}

{{/* ServiceAccounts: serviceAccount.name gives the reference's names (<name>-controller,
     <name>-kubeletplugin); without it, ours. */}}
{{- define "cd.controllerServiceAccount" -}}
{{- with .Values.serviceAccount.name }}{{ . }}-controller{{ else }}{{ include "cd.fullname" . }}-controller{{ end -}}
{{- end -}}
{{- define "cd.kubeletPluginServiceAccount" -}}
{{- with .Values.serviceAccount.name }}{{ . }}-kubeletplugin{{ else }}{{ include "cd.fullname" . }}-kubelet-plugin{{ end -}}
{{- end -}}
{{/* A ServiceAccount's metadata annotations (serviceAccount.annotations), or nothing. */}}
{{- define "cd.serviceAccountAnnotations" -}}
{{- with .Values.serviceAccount.annotations -}}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}
{{/* Fixed: the controller puts this name into every daemon pod it creates. */}}
{{- define "cd.daemonServiceAccount" -}}compute-domain-daemon-service-account{{- end -}}

{{- define "cd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "cd.hostManaged" -}}
{{- if eq (toString .Values.resources.computeDomains.imex.mode) "hostManaged" -}}true{{- end -}}
{{- end -}}

{{/* The value of the env entry .name in the EnvVar list .list ("" when absent or not a plain value). */}}
{{- define "cd.envValue" -}}
{{- range .list | default list -}}
{{- if and (kindIs "map" .) (eq (toString .name) $.name) (hasKey . "value") -}}{{ toString .value }}{{- end -}}
{{- end -}}
{{- end -}}

{{/* More namespaces the daemons may run in: additionalNamespaces, or the ADDITIONAL_NAMESPACES entry of the
     controller's env (the reference chart's way; cd.validate refuses both). */}}
{{- define "cd.additionalNamespaces" -}}
{{- $extra := list -}}
{{- range .Values.additionalNamespaces -}}{{- $extra = append $extra (toString .) -}}{{- end -}}
{{- $fromEnv := include "cd.envValue" (dict "list" .Values.controller.containers.computeDomain.env "name" "ADDITIONAL_NAMESPACES") -}}
{{- range splitList "," $fromEnv -}}
{{- with trim . -}}{{- $extra = append $extra . -}}{{- end -}}
{{- end -}}
{{- toJson $extra -}}
{{- end -}}

{{/* The namespaces the controller manages: the release namespace, then the additional ones. */}}
{{- define "cd.managedNamespaces" -}}
{{- $all := list (include "cd.namespace" .) -}}
{{- range include "cd.additionalNamespaces" . | fromJsonArray -}}
{{- if not (has . $all) -}}{{- $all = append $all . -}}{{- end -}}
{{- end -}}
{{- toJson $all -}}
{{- end -}}

{{/* Names of the pull secrets: imagePullSecrets items are {name: ...} objects (the reference's shape) or
     names. */}}
{{- define "cd.pullSecretNames" -}}
{{- $names := list -}}
{{- range .Values.imagePullSecrets -}}
{{- if kindIs "map" . -}}{{- $names = append $names (toString .name) -}}{{- else -}}{{- $names = append $names (toString .) -}}{{- end -}}
{{- end -}}
{{- toJson $names -}}
{{- end -}}

{{/* A pod spec's imagePullSecrets, or nothing. */}}
{{- define "cd.podPullSecrets" -}}
{{- with include "cd.pullSecretNames" . | fromJsonArray -}}
imagePullSecrets:
{{- range . }}
- name: {{ . }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* Seconds of a duration value: a number (seconds), or text: seconds ("15") or a Go duration ("15s",
     "1m30s", "500ms"). "" when it is neither (cd.validate says so). */}}
{{- define "cd.seconds" -}}
{{- $v := . -}}
{{- if or (kindIs "float64" $v) (kindIs "int" $v) (kindIs "int64" $v) -}}
{{- float64 $v -}}
{{- else -}}
{{- $s := trim (toString $v) -}}
{{- $number := "([0-9]+(\\.[0-9]*)?|\\.[0-9]+)" -}}
{{- $unit := "(ns|us|µs|μs|ms|s|m|h)" -}}
{{- if regexMatch (printf "^%s$" $number) $s -}}
{{- float64 $s -}}
{{- else if regexMatch (printf "^(%s%s)+$" $number $unit) $s -}}
{{- $scale := dict "ns" 1e-9 "us" 1e-6 "µs" 1e-6 "μs" 1e-6 "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0 -}}
{{- $total := 0.0 -}}
{{- range regexFindAll (printf "%s%s" $number $unit) $s -1 -}}
{{- $digits := regexFind "^[0-9.]+" . -}}
{{- $total = addf $total (mulf (float64 $digits) (get $scale (trimPrefix $digits .))) -}}
{{- end -}}
{{- $total -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A duration value as the processes read it: text as it is (seconds or a Go duration), a number as
     "<n>s". */}}
{{- define "cd.duration" -}}
{{- if kindIs "string" . -}}{{ trim . }}{{- else -}}{{ printf "%vs" . }}{{- end -}}
{{- end -}}

{{/* The Lease name: controller.leaderElection.leaseName, else the reference chart's. */}}
{{- define "cd.leaseName" -}}
{{- default (printf "%s-controller" (include "cd.referenceName" .)) .Values.controller.leaderElection.leaseName -}}
{{- end -}}

{{/* The port of an endpoint "host:port" (":8080"). */}}
{{- define "cd.endpointPort" -}}
{{- regexFind "[0-9]+$" (toString .) -}}
{{- end -}}

{{/* The node agent's health port: a HEALTHCHECK_PORT entry of its env (the reference's users set it
     there) wins over kubeletPlugin.containers.computeDomains.healthcheckPort, so the probes dial the port
     the agent serves. */}}
{{- define "cd.healthcheckPort" -}}
{{- $cd := .Values.kubeletPlugin.containers.computeDomains -}}
{{- default (toString $cd.healthcheckPort) (include "cd.envValue" (dict "list" $cd.env "name" "HEALTHCHECK_PORT")) -}}
{{- end -}}

{{/* FEATURE_GATES: the featureGates map as "Name=bool," pairs in key order (trailing comma, as the
     reference renders it; the processes ignore empty items). */}}
{{- define "cd.featureGates" -}}
{{- range $name, $value := .Values.featureGates -}}
{{- printf "%s=%s," $name (include "cd.bool" $value) -}}
{{- end -}}
{{- end -}}

{{/* A map as "KEY=VALUE," pairs in key order, values trimmed (IMEX_CONFIG_OVERRIDES, CD_DAEMON_RESOURCES: the
     reference's form of resources.computeDomains.imex.config). */}}
{{- define "cd.pairs" -}}
{{- range $key, $value := . -}}
{{- printf "%s=%s," (trim $key) (trim (toString $value)) -}}
{{- end -}}
{{- end -}}

{{/* "true"/"false" for a boolean value in any form Go's strconv.ParseBool reads (1, t, TRUE, ...) or any
     case of true/false; anything else as lower-case text (cd.validate refuses it). */}}
{{- define "cd.bool" -}}
{{- $text := toString . -}}
{{- if or (eq (lower $text) "true") (has $text (list "1" "t" "T")) -}}true
{{- else if or (eq (lower $text) "false") (has $text (list "0" "f" "F")) -}}false
{{- else -}}{{ lower $text }}
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
  value: {{ default "info" (toString .Values.logLevel) | quote }}
{{- with toString .Values.logVerbosity }}
# The reference's klog verbosity; when set it decides the level (6 and up: debug).
- name: LOG_VERBOSITY
  value: {{ . | quote }}
{{- end }}
- name: LOG_FORMAT
  value: {{ .Values.logFormat | toString | quote }}
{{- end -}}
