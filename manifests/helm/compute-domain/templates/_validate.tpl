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

{{- define "cd.knownGates" -}}IMEXDaemonsWithDNSNames ComputeDomainCliques CrashOnNVLinkFabricErrors HostManagedIMEXDaemon IMEXChannelIsolation{{- end -}}
{{/* The reference driver's GPU-plugin and logging gates: a shared FEATURE_GATES carries them. */}}
{{- define "cd.foreignGates" -}}TimeSlicingSettings MPSSupport PassthroughSupport DynamicMIG NVMLDeviceHealthCheck DeviceMetadata FabricManagerPartitioning DRAListTypeAttributes ConsumableShares AllAlpha AllBeta ContextualLogging LoggingAlphaOptions LoggingBetaOptions{{- end -}}
{{- define "cd.gateDefaults" -}}{"IMEXDaemonsWithDNSNames": true, "ComputeDomainCliques": true, "CrashOnNVLinkFabricErrors": true, "HostManagedIMEXDaemon": false, "IMEXChannelIsolation": false}{{- end -}}

{{/* "true"/"false": the effective value of gate .name under .values. */}}
{{- define "cd.gateEnabled" -}}
{{- $defaults := include "cd.gateDefaults" . | fromJson -}}
{{- if hasKey .values.featureGates .name -}}
{{- include "cd.bool" (index .values.featureGates .name) -}}
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
{{- $text := include "cd.bool" $value -}}
{{- if not (has $text (list "true" "false")) -}}
{{- fail (printf "FEATURE_GATES: item %s must look like Name=true or Name=false (values: featureGates.%s)" (include "cd.repr" (printf "%s=%s" $name (toString $value))) $name) -}}
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
{{- /* Without the gate IMEXChannelIsolation, "channel" is refused with the message it always had. */ -}}
{{- $isolated := eq (include "cd.gateEnabled" (dict "values" $v "name" "IMEXChannelIsolation")) "true" -}}
{{- if eq $isolation "channel" -}}
{{- if not $isolated -}}
{{- fail "IMEX_ISOLATION=channel is not implemented yet; use domain (values: resources.computeDomains.imex.isolation)" -}}
{{- end -}}
{{- if ne $mode "hostManaged" -}}
{{- fail "IMEX_ISOLATION=channel needs IMEX_MODE=hostManaged: in driverManaged mode every ComputeDomain runs an IMEX domain of its own, which isolates it already; use domain (values: resources.computeDomains.imex.isolation)" -}}
{{- end -}}
{{- else if ne $isolation "domain" -}}
{{- fail (printf "IMEX_ISOLATION %s is unknown; use %s (values: resources.computeDomains.imex.isolation)" (include "cd.repr" $isolation) (ternary "domain or channel" "domain" $isolated)) -}}
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

{{- $level := default "info" (toString $v.logLevel) -}}
{{- if not (has (lower $level) (list "debug" "info" "warning" "error")) -}}
{{- fail (printf "LOG_LEVEL %s: use debug, info, warning or error (values: logLevel)" (include "cd.repr" $level)) -}}
{{- end -}}
{{- with toString $v.logVerbosity -}}
{{- if not (regexMatch "^[0-9]{1,3}$" (trim .)) -}}
{{- fail (printf "LOG_VERBOSITY %s must be a klog verbosity, 0 to 7 (6 and up: debug) (values: logVerbosity)" (include "cd.repr" .)) -}}
{{- end -}}
{{- if $v.logLevel -}}
{{- fail "logLevel and logVerbosity are both set: keep one (logVerbosity is the reference chart's klog level, 6 and up: debug) (values: logVerbosity)" -}}
{{- end -}}
{{- end -}}
{{- $format := toString $v.logFormat -}}
{{- if not (has $format (list "text" "json")) -}}
{{- fail (printf "LOG_FORMAT %s: use text or json (values: logFormat)" (include "cd.repr" $format)) -}}
{{- end -}}
{{- $daemonLevel := default "info" (toString (default $v.logLevel $v.controller.daemonLogLevel)) -}}
{{- if not (has (lower $daemonLevel) (list "debug" "info" "warning" "error")) -}}
{{- fail (printf "LOG_LEVEL %s: use debug, info, warning or error (values: controller.daemonLogLevel)" (include "cd.repr" $daemonLevel)) -}}
{{- end -}}

{{- /* Controller rules. */ -}}
{{- if or (lt (int $v.maxNodesPerIMEXDomain) 1) (gt (int $v.maxNodesPerIMEXDomain) 10000) -}}
{{- fail "MAX_NODES_PER_IMEX_DOMAIN must be at least 1 and at most 10000 (GB200/GB300 NVL72: 18) (values: maxNodesPerIMEXDomain)" -}}
{{- end -}}
{{- $count := ternary $imex.channelCount 2048 (hasKey $imex "channelCount") -}}
{{- if or (lt (int $count) 2) (gt (int $count) 1048576) -}}
{{- fail (printf "IMEX_CHANNEL_COUNT %s must be between 2 and 1048576 (channel 0 is reserved; the driver's default NVreg_ImexChannelCount is 2048) (values: resources.computeDomains.imex.channelCount)" (toString $count)) -}}
{{- end -}}
{{- if hasKey $imex "channelIdleRelease" -}}
{{- if eq (include "cd.seconds" $imex.channelIdleRelease) "" -}}
{{- fail (printf "IMEX_CHANNEL_IDLE_RELEASE %s is not a duration; use seconds (15) or a Go duration (15s) (values: resources.computeDomains.imex.channelIdleRelease)" (include "cd.repr" (include "cd.duration" $imex.channelIdleRelease))) -}}
{{- end -}}
{{- end -}}
{{- /* IMEX config overrides (computedomain/settings.py parse_imex_config_overrides), in key order. */ -}}
{{- $owned := dict "IMEX_CMD_BIND_INTERFACE_IP" "the pod IP, where the probes reach the command service" "IMEX_NODE_CONFIG_FILE" "the domain's nodes.cfg, which the daemon writes" "IMEX_CMD_ENABLED" "the probes need the command service" "IMEX_CMD_PORT" "the probes and the daemons' NetworkPolicy use 50005" "SERVER_PORT" "the peers and the daemons' NetworkPolicy use 50000" "DAEMONIZE" "the daemon supervises nvidia-imex in the foreground" -}}
{{- $config := $imex.config | default dict -}}
{{- if not (kindIs "map" $config) -}}
{{- fail "resources.computeDomains.imex.config must be a map of nvidia-imex setting to value, e.g. {IMEX_NODE_DISCONNECTED_GRACE_TIME: \"60\"} (values: resources.computeDomains.imex.config)" -}}
{{- end -}}
{{- range $key, $value := $config -}}
{{- $k := trim $key -}}{{- $text := trim (toString $value) -}}
{{- $shown := printf "'%s'" ($k | replace "\\" "\\\\" | replace "'" "\\'" | replace "\r" "\\r" | replace "\n" "\\n") -}}
{{- if regexMatch "[\r\n]" $k -}}
{{- fail (printf "IMEX_CONFIG_OVERRIDES: key %s contains a newline; one key per setting (values: resources.computeDomains.imex.config)" $shown) -}}
{{- end -}}
{{- if regexMatch "[\r\n]" $text -}}
{{- fail (printf "IMEX_CONFIG_OVERRIDES: the value of %s contains a newline; a value is one line (values: resources.computeDomains.imex.config.%s)" $shown $k) -}}
{{- end -}}
{{- if contains "," $text -}}
{{- fail (printf "IMEX_CONFIG_OVERRIDES: the value of %s contains ','; the settings travel as KEY=VALUE,KEY=VALUE (values: resources.computeDomains.imex.config.%s)" $shown $k) -}}
{{- end -}}
{{- if not (regexMatch "^[A-Z][A-Z0-9_]{0,63}$" $k) -}}
{{- fail (printf "IMEX_CONFIG_OVERRIDES: item %s must look like KEY=VALUE with an nvidia-imex setting name (upper case, digits, '_') as KEY, and no ',' in VALUE (values: resources.computeDomains.imex.config)" (include "cd.repr" (printf "%s=%s" $k $text))) -}}
{{- end -}}
{{- if hasKey $owned $k -}}
{{- fail (printf "IMEX_CONFIG_OVERRIDES: %s is set by the service (%s); remove it (values: resources.computeDomains.imex.config.%s)" $k (index $owned $k) $k) -}}
{{- end -}}
{{- if or (gt (len $text) 1024) (regexMatch "[\\x00-\\x1f\\x7f]" $text) -}}
{{- fail (printf "IMEX_CONFIG_OVERRIDES: the value of %s must be printable and at most 1024 characters (values: resources.computeDomains.imex.config.%s)" $k $k) -}}
{{- end -}}
{{- end -}}
{{- if gt (len $config) 64 -}}
{{- fail (printf "IMEX_CONFIG_OVERRIDES: %d settings, at most 64 (values: resources.computeDomains.imex.config)" (len $config)) -}}
{{- end -}}
{{- /* The IMEX daemon pods' priority class and resources (controller settings). */ -}}
{{- with toString (default "" $v.controller.priorityClassName) -}}
{{- if not (regexMatch "^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$" .) -}}
{{- fail (printf "CD_DAEMON_PRIORITY_CLASS_NAME %s is not a PriorityClass name (a lower-case DNS subdomain, e.g. system-node-critical) (values: controller.priorityClassName)" (include "cd.repr" .)) -}}
{{- end -}}
{{- end -}}
{{- $daemonResources := $v.controller.daemonResources | default dict -}}
{{- range $name, $value := $daemonResources -}}
{{- $q := trim (toString $value) -}}
{{- if not (has $name (list "cpu" "memory")) -}}
{{- fail (printf "CD_DAEMON_RESOURCES: item %s must be cpu=QUANTITY or memory=QUANTITY (values: controller.daemonResources)" (include "cd.repr" (printf "%s=%s" $name $q))) -}}
{{- end -}}
{{- if not (and (regexMatch "^[0-9]{1,15}(\\.[0-9]{1,9})?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$" $q) (regexMatch "[1-9]" $q)) -}}
{{- fail (printf "CD_DAEMON_RESOURCES: %s %s is not a positive quantity (e.g. 250m, 256Mi) (values: controller.daemonResources.%s)" $name (include "cd.repr" $q) $name) -}}
{{- end -}}
{{- end -}}
{{- if and $daemonResources (not (and (hasKey $daemonResources "cpu") (hasKey $daemonResources "memory"))) -}}
{{- fail "CD_DAEMON_RESOURCES: set both cpu and memory (requests equal to limits: Guaranteed QoS), or neither (values: controller.daemonResources)" -}}
{{- end -}}
{{- $le := $v.controller.leaderElection -}}
{{- $seconds := dict -}}
{{- range $key, $env := dict "leaseDuration" "LEADER_ELECTION_LEASE_DURATION" "renewDeadline" "LEADER_ELECTION_RENEW_DEADLINE" "retryPeriod" "LEADER_ELECTION_RETRY_PERIOD" -}}
{{- $value := index $le $key -}}
{{- $n := include "cd.seconds" $value -}}
{{- if eq $n "" -}}
{{- fail (printf "%s %s is not a duration; use seconds (15) or a Go duration (15s) (values: controller.leaderElection.%s)" $env (include "cd.repr" (include "cd.duration" $value)) $key) -}}
{{- end -}}
{{- $_ := set $seconds $key (float64 $n) -}}
{{- end -}}
{{- if $le.enabled -}}
{{- $ld := $seconds.leaseDuration -}}{{- $rd := $seconds.renewDeadline -}}{{- $rp := $seconds.retryPeriod -}}
{{- if not (and (gt $ld $rd) (gt $rd $rp) (gt $rp 0.0)) -}}
{{- fail "LEADER_ELECTION_*: need lease duration > renew deadline > retry period > 0 (defaults 15/10/2) (values: controller.leaderElection)" -}}
{{- end -}}
{{- end -}}

{{- /* Node agent rules. */ -}}
{{- $perNode := ternary $imex.channelClaimsPerNode 8 (hasKey $imex "channelClaimsPerNode") -}}
{{- if or (lt (int $perNode) 1) (gt (int $perNode) 128) -}}
{{- fail (printf "IMEX_CHANNEL_CLAIMS_PER_NODE %s must be between 1 and 128 (one ResourceSlice holds 128 devices) (values: resources.computeDomains.imex.channelClaimsPerNode)" (toString $perNode)) -}}
{{- end -}}
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

{{- include "cd.validateReference" . -}}
{{- end -}}

{{/*
The reference chart's keys and shapes (docs/migrate.md): what this chart honours is
checked here, what it cannot honour fails with what to use instead. The default-namespace rule comes last.
*/}}
{{- define "cd.validateReference" -}}
{{- $v := .Values -}}
{{- range $i, $item := $v.imagePullSecrets -}}
{{- if not (or (and (kindIs "string" $item) $item) (and (kindIs "map" $item) (kindIs "string" $item.name) $item.name)) -}}
{{- fail (printf "imagePullSecrets[%d]: use {name: SECRET} (or the secret's name) (values: imagePullSecrets)" $i) -}}
{{- end -}}
{{- end -}}
{{- if and (not $v.serviceAccount.create) (not $v.serviceAccount.name) -}}
{{- fail "serviceAccount.create=false needs serviceAccount.name: the chart then uses the ServiceAccounts <name>-controller and <name>-kubeletplugin, which must exist (values: serviceAccount.name)" -}}
{{- end -}}
{{- if and $v.additionalNamespaces (include "cd.envValue" (dict "list" $v.controller.containers.computeDomain.env "name" "ADDITIONAL_NAMESPACES")) -}}
{{- fail "additionalNamespaces and an ADDITIONAL_NAMESPACES entry in controller.containers.computeDomain.env are both set: keep one (values: additionalNamespaces)" -}}
{{- end -}}
{{- $endpoints := dict "controller.metrics.httpEndpoint" $v.controller.metrics.httpEndpoint -}}
{{- if $v.kubeletPlugin.metrics.enabled -}}{{- $_ := set $endpoints "kubeletPlugin.metrics.computeDomainHttpEndpoint" $v.kubeletPlugin.metrics.computeDomainHttpEndpoint -}}{{- end -}}
{{- range $key, $endpoint := $endpoints -}}
{{- $port := include "cd.endpointPort" $endpoint -}}
{{- if not (and (regexMatch "^(\\[[0-9a-fA-F:.]*\\]|[A-Za-z0-9._-]*):[0-9]{1,5}$" (toString $endpoint)) (le (int $port) 65535) (gt (int $port) 0)) -}}
{{- fail (printf "HTTP_ENDPOINT %s must look like host:port, :port or [v6]:port, with a port from 1 to 65535 (values: %s)" (include "cd.repr" (toString $endpoint)) $key) -}}
{{- end -}}
{{- end -}}
{{- $health := include "cd.healthcheckPort" . -}}
{{- if not (and (regexMatch "^-?[0-9]{1,5}$" $health) (le (int $health) 65535)) -}}
{{- fail (printf "HEALTHCHECK_PORT %s must be a port number (0: random, negative: no health server) (values: kubeletPlugin.containers.computeDomains.healthcheckPort)" (include "cd.repr" $health)) -}}
{{- end -}}
{{- /* Keys of the reference chart that this chart cannot honour. */ -}}
{{- if $v.resources.gpus.enabled -}}
{{- fail "resources.gpus.enabled=true: this chart serves ComputeDomains (compute-domain.nvidia.com) only; keep the reference chart for GPUs (gpu.nvidia.com) with resources.computeDomains.enabled=false there, and set resources.gpus.enabled=false here (values: resources.gpus.enabled)" -}}
{{- end -}}
{{- with $v.resourceApiVersion -}}
{{- if ne (toString .) "resource.k8s.io/v1" -}}
{{- fail (printf "resourceApiVersion %s: this service needs resource.k8s.io/v1 (Kubernetes 1.34 or later); set it to resource.k8s.io/v1 or leave it empty (values: resourceApiVersion)" (include "cd.repr" (toString .))) -}}
{{- end -}}
{{- end -}}
{{- with $v.controller.metrics.profilePath -}}
{{- fail (printf "controller.metrics.profilePath %s: this service has no Go profiler; send SIGUSR2 to the controller for every task's stack in its log, and leave profilePath empty (values: controller.metrics.profilePath)" (include "cd.repr" (toString .))) -}}
{{- end -}}
{{- with $v.altProcDevices -}}
{{- fail "altProcDevices: the node agent reads the driver's /proc files from PROC_ROOT; for a fake driver root set kubeletPlugin.containers.computeDomains.env [{name: PROC_ROOT, value: /driver-root/proc}] instead (values: altProcDevices)" -}}
{{- end -}}
{{- with $v.nvidiaCtkPath -}}
{{- fail "nvidiaCtkPath is no longer supported (nor by the reference chart); remove it (values: nvidiaCtkPath)" -}}
{{- end -}}
{{- with $v.namespace -}}
{{- fail "namespace: set the namespace with helm --namespace NAME (or namespaceOverride), not a value named namespace (values: namespace)" -}}
{{- end -}}
{{- if and $v.monitoring.podMonitor.enabled $v.monitoring.serviceMonitor.enabled -}}
{{- fail "monitoring.podMonitor and monitoring.serviceMonitor are both enabled: Prometheus would scrape every pod twice; keep one (values: monitoring.serviceMonitor.enabled)" -}}
{{- end -}}
{{- if and (eq (include "cd.namespace" .) "default") (not $v.allowDefaultNamespace) -}}
{{- fail "the namespace is \"default\": install into a namespace of its own (helm install --namespace NAME --create-namespace), or set allowDefaultNamespace=true (values: allowDefaultNamespace)" -}}
{{- end -}}
{{- end -}}
