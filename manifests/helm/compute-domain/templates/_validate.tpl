{{/*
Startup validation of SPEC section 3, in the order the processes check it (computedomain/settings.py),
with the same one-line messages, so `helm template` fails where the pods would crash-loop. Each message
is followed by the value to change. tests/unit/manifests/test_helm_validation.py renders every rule
and compares the text with SettingsError's.
*/}}

{{/* Python's repr() of a string, for messages that quote a value. */}}
{{- define "cd.repr" -}}
{{- $s := toString . -}}
{{- if and (contains "'" $s) (not (contains "\"" $s)) -}}"{{ $s }}"{{- else -}}'{{ $s | replace "\\" "\\\\" | replace "'" "\\'" }}'{{- end -}}
{{- end -}}

{{- define "cd.knownGates" -}}IMEXDaemonsWithDNSNames ComputeDomainCliques CrashOnNVLinkFabricErrors HostManagedIMEXDaemon{{- end -}}
{{/* The reference driver's GPU-plugin and logging gates: a shared FEATURE_GATES carries them. */}}
{{- define "cd.foreignGates" -}}TimeSlicingSettings MPSSupport PassthroughSupport DynamicMIG NVMLDeviceHealthCheck DeviceMetadata FabricManagerPartitioning DRAListTypeAttributes ConsumableShares AllAlpha AllBeta ContextualLogging LoggingAlphaOptions LoggingBetaOptions{{- end -}}
{{- define "cd.gateDefaults" -}}{"IMEXDaemonsWithDNSNames": true, "ComputeDomainCliques": true, "CrashOnNVLinkFabricErrors": true, "HostManagedIMEXDaemon": false}{{- end -}}

{{/* "true"/"false": the effective value of gate .name under .values. */}}
{{- define "cd.gateEnabled" -}}
{{- $defaults := include "cd.gateDefaults" . | fromJson -}}
{{- if hasKey .values.featureGates .name -}}
{{- lower (toString (index .values.featureGates .name)) -}}
{{- else -}}
{{- toString (index $defaults .name) -}}
{{- end -}}
{{- end -}}

{{- define "cd.validate" -}}
{{- $v := .Values -}}
{{- $known := splitList " " (include "cd.knownGates" .) -}}
{{- $foreign := splitList " " (include "cd.foreignGates" .) -}}

{{- /* Feature gates: every item Name=true|false, every name known. */ -}}
{{- range $name, $value := $v.featureGates -}}
{{- $text := lower (toString $value) -}}
{{- if not (has $text (list "true" "false")) -}}
{{- fail (printf "FEATURE_GATES: item %s must look like Name=true or Name=false (values: featureGates.%s)" (include "cd.repr" (printf "%s=%s" $name $text)) $name) -}}
{{- end -}}
{{- if not (or (has $name $known) (has $name $foreign)) -}}
{{- fail (printf "FEATURE_GATES: unknown gate %s; known gates: %s (values: featureGates)" (include "cd.repr" $name) (join ", " $known)) -}}
{{- end -}}
{{- end -}}

{{- /* Rules 1-4: the mode and its gate before the isolation. */ -}}
{{- $imex := $v.resources.computeDomains.imex | default dict -}}
{{- $mode := toString (default "" $imex.mode) -}}
{{- $isolation := toString (default "" $imex.isolation) -}}
{{- $socket := toString (default "" $imex.hostSocketPath) -}}
{{- if not (has $mode (list "driverManaged" "hostManaged")) -}}
{{- fail (printf "IMEX_MODE %s is unknown; use driverManaged or hostManaged (values: resources.computeDomains.imex.mode)" (include "cd.repr" $mode)) -}}
{{- end -}}
{{- if and (eq $mode "hostManaged") (ne (include "cd.gateEnabled" (dict "values" $v "name" "HostManagedIMEXDaemon")) "true") -}}
{{- fail "IMEX_MODE=hostManaged requires the feature gate HostManagedIMEXDaemon=true (FEATURE_GATES) (values: featureGates.HostManagedIMEXDaemon)" -}}
{{- end -}}
{{- if eq $isolation "channel" -}}
{{- fail "IMEX_ISOLATION=channel is not implemented yet; use domain (values: resources.computeDomains.imex.isolation)" -}}
{{- end -}}
{{- if ne $isolation "domain" -}}
{{- fail (printf "IMEX_ISOLATION %s is unknown; use domain (values: resources.computeDomains.imex.isolation)" (include "cd.repr" $isolation)) -}}
{{- end -}}

{{- /* Rule 5; in hostManaged mode the DNS-name and clique gates are forced off, so it does not apply. */ -}}
{{- if and (eq $mode "driverManaged") (eq (include "cd.gateEnabled" (dict "values" $v "name" "ComputeDomainCliques")) "true") (ne (include "cd.gateEnabled" (dict "values" $v "name" "IMEXDaemonsWithDNSNames")) "true") -}}
{{- fail "FEATURE_GATES: ComputeDomainCliques=true requires IMEXDaemonsWithDNSNames=true; enable IMEXDaemonsWithDNSNames or set ComputeDomainCliques=false (values: featureGates)" -}}
{{- end -}}

{{- /* Rule 7: absolute, normalised (as Python's posixpath.normpath leaves it), no "..", no leading "//". */ -}}
{{- $bad := not (hasPrefix "/" $socket) -}}
{{- $rest := trimPrefix "/" $socket -}}
{{- /* A leading "//" survives POSIX normalisation but is refused too, as are control characters. */ -}}
{{- if or (hasPrefix "//" $socket) (regexMatch "[\\x00-\\x1f\\x7f]" $socket) -}}{{- $bad = true -}}{{- end -}}
{{- if and (not $bad) (ne $rest "") -}}
{{- range splitList "/" $rest -}}
{{- if has . (list "" "." "..") -}}{{- $bad = true -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- if $bad -}}
{{- fail (printf "IMEX_HOST_SOCKET_PATH %s must be an absolute, normalised path without '..' (relative to the driver root), e.g. /etc/nvidia-imex/imex_ctrl.sock (values: resources.computeDomains.imex.hostSocketPath)" (include "cd.repr" $socket)) -}}
{{- end -}}

{{- $level := toString $v.logLevel -}}
{{- if not (has (lower $level) (list "debug" "info" "warning" "error")) -}}
{{- fail (printf "LOG_LEVEL %s: use debug, info, warning or error (values: logLevel)" (include "cd.repr" $level)) -}}
{{- end -}}
{{- $format := toString $v.logFormat -}}
{{- if not (has $format (list "text" "json")) -}}
{{- fail (printf "LOG_FORMAT %s: use text or json (values: logFormat)" (include "cd.repr" $format)) -}}
{{- end -}}
{{- $daemonLevel := toString (default $v.logLevel $v.controller.daemonLogLevel) -}}
{{- if not (has (lower $daemonLevel) (list "debug" "info" "warning" "error")) -}}
{{- fail (printf "LOG_LEVEL %s: use debug, info, warning or error (values: controller.daemonLogLevel)" (include "cd.repr" $daemonLevel)) -}}
{{- end -}}

{{- /* Controller rules. */ -}}
{{- if or (lt (int $v.maxNodesPerIMEXDomain) 1) (gt (int $v.maxNodesPerIMEXDomain) 10000) -}}
{{- fail "MAX_NODES_PER_IMEX_DOMAIN must be at least 1 and at most 10000 (GB200/GB300 NVL72: 18) (values: maxNodesPerIMEXDomain)" -}}
{{- end -}}
{{- $le := $v.controller.leaderElection -}}
{{- if $le.enabled -}}
{{- $ld := float64 $le.leaseDuration -}}{{- $rd := float64 $le.renewDeadline -}}{{- $rp := float64 $le.retryPeriod -}}
{{- if not (and (gt $ld $rd) (gt $rd $rp) (gt $rp 0.0)) -}}
{{- fail "LEADER_ELECTION_*: need lease duration > renew deadline > retry period > 0 (defaults 15/10/2) (values: controller.leaderElection)" -}}
{{- end -}}
{{- end -}}

{{- /* Node agent rules. */ -}}
{{- $cdi := toString $v.kubeletPlugin.cdiRoot -}}
{{- if not (hasPrefix "/" $cdi) -}}
{{- fail (printf "CDI_ROOT %s must be an absolute path (values: kubeletPlugin.cdiRoot)" (include "cd.repr" $cdi)) -}}
{{- end -}}
{{- $rootKey := "nvidiaDriverRoot" -}}
{{- with $v.kubeletPlugin.nvidiaDriverRoot -}}
{{- $rootKey = "kubeletPlugin.nvidiaDriverRoot" -}}
{{- $top := toString (default "/" $v.nvidiaDriverRoot) -}}
{{- if and (ne $top "/") (ne $top (toString .)) -}}
{{- fail (printf "nvidiaDriverRoot %s and kubeletPlugin.nvidiaDriverRoot %s (its older name) differ: set only nvidiaDriverRoot (values: nvidiaDriverRoot)" (include "cd.repr" $top) (include "cd.repr" (toString .))) -}}
{{- end -}}
{{- end -}}
{{- $root := include "cd.driverRoot" . -}}
{{- if not (hasPrefix "/" $root) -}}
{{- fail (printf "NVIDIA_DRIVER_ROOT %s must be an absolute path (values: %s)" (include "cd.repr" $root) $rootKey) -}}
{{- end -}}

{{- /* Operators' env lists: EnvVar objects, one entry per name; the driver root has its own value. */ -}}
{{- $lists := dict "kubeletPlugin.containers.computeDomains.env" ((($v.kubeletPlugin.containers | default dict).computeDomains | default dict).env) "controller.containers.computeDomain.env" ((($v.controller.containers | default dict).computeDomain | default dict).env) -}}
{{- range $key, $list := $lists -}}
{{- if and $list (not (kindIs "slice" $list)) -}}
{{- fail (printf "%s must be a list of EnvVar objects such as {name: PROC_ROOT, value: /driver-root/proc} (values: %s)" $key $key) -}}
{{- end -}}
{{- $seen := dict -}}
{{- range $i, $item := $list -}}
{{- if not (and (kindIs "map" $item) (kindIs "string" $item.name) (regexMatch "^[-._a-zA-Z][-._a-zA-Z0-9]*$" (toString $item.name))) -}}
{{- fail (printf "%s[%d]: every item is an EnvVar object with a name such as {name: PROC_ROOT, value: /driver-root/proc} (values: %s)" $key $i $key) -}}
{{- end -}}
{{- if hasKey $seen $item.name -}}
{{- fail (printf "%s[%d]: %s is listed twice; keep one entry (values: %s)" $key $i $item.name $key) -}}
{{- end -}}
{{- $_ := set $seen $item.name true -}}
{{- if has $item.name (list "NVIDIA_DRIVER_ROOT" "CONTAINER_DRIVER_ROOT") -}}
{{- fail (printf "%s[%d]: %s follows the driver root the chart mounts; set nvidiaDriverRoot instead (values: %s)" $key $i $item.name $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
