{{/* Names and pieces shared by the templates. Every name is prefixed eagle3. (Helm template names are global). */}}

{{- define "eagle3.prefix" -}}
eagle3-{{ .Values.run.id }}
{{- end }}

{{- define "eagle3.configMapName" -}}
{{ include "eagle3.prefix" . }}-config
{{- end }}

{{- define "eagle3.serveName" -}}
{{ include "eagle3.prefix" . }}-serve
{{- end }}

{{/* Labels every object carries (namespace-level objects: RBAC, the shared model cache). */}}
{{- define "eagle3.baseLabels" -}}
app.kubernetes.io/name: eagle3
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: eagle3ctl
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* Labels of the run's objects: `eagle3ctl down` deletes everything with eagle3.io/run=<id>. */}}
{{- define "eagle3.runLabels" -}}
{{ include "eagle3.baseLabels" . }}
eagle3.io/run: {{ .Values.run.id | quote }}
{{- end }}

{{/* Selector labels of a stage's pods (stable across chart upgrades). ctx: root; stage: name. */}}
{{- define "eagle3.stageSelector" -}}
app.kubernetes.io/name: eagle3
eagle3.io/run: {{ .ctx.Values.run.id | quote }}
eagle3.io/stage: {{ .stage }}
{{- end }}

{{- define "eagle3.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "eagle3.containerSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
capabilities:
  drop: ["ALL"]
{{- end }}

{{- define "eagle3.imagePullSecrets" -}}
{{- with .Values.images.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* Credentials come only as Secret references, never a value in a manifest, and each pod gets
only those its stage needs. ctx: root; secrets: list of s3, hf, apiKey (as EAGLE3_API_KEY), serveKey (as VLLM_API_KEY). */}}
{{- define "eagle3.secretEnv" -}}
{{- $v := .ctx.Values.secrets }}
{{- if and (has "s3" .secrets) $v.s3.name }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $v.s3.name }}
      key: {{ $v.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $v.s3.name }}
      key: {{ $v.s3.secretAccessKeyKey }}
{{- end }}
{{- if and (has "hf" .secrets) $v.hf.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $v.hf.name }}
      key: {{ $v.hf.tokenKey }}
{{- end }}
{{- if $v.apiKey.name }}
{{- if has "apiKey" .secrets }}
- name: EAGLE3_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $v.apiKey.name }}
      key: {{ $v.apiKey.key }}
{{- end }}
{{- if has "serveKey" .secrets }}
# vLLM reads the key from VLLM_API_KEY exactly as from --api-key, and an env value is not
# echoed in its "non-default args" log line or the process's command line.
- name: VLLM_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $v.apiKey.name }}
      key: {{ $v.apiKey.key }}
{{- end }}
{{- end }}
{{- end }}

{{/* Environment of every eagle3 container: caches on writable volumes, no telemetry, its Secrets. ctx: root; secrets: list. */}}
{{- define "eagle3.env" -}}
- name: HOME
  value: /work
- name: HF_HOME
  value: {{ .ctx.Values.modelCache.mountPath }}/hf
- name: MPLCONFIGDIR
  value: /work/.matplotlib
- name: HF_HUB_DISABLE_TELEMETRY
  value: "1"
- name: PYTHONUNBUFFERED
  value: "1"
{{- include "eagle3.secretEnv" . }}
{{- end }}

{{/* Volumes: the config, a writable work dir, the model cache (PVC on GPU pods), the file store. ctx: root; gpu: bool. */}}
{{- define "eagle3.volumes" -}}
- name: config
  configMap:
    name: {{ include "eagle3.configMapName" .ctx }}
- name: work
  emptyDir: {}
- name: model-cache
{{- if .gpu }}
  persistentVolumeClaim:
    claimName: {{ .ctx.Values.modelCache.pvc }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .ctx.Values.gpu.shmSize }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- if .ctx.Values.store.pvc }}
- name: store
  persistentVolumeClaim:
    claimName: {{ .ctx.Values.store.pvc }}
{{- end }}
{{- end }}

{{- define "eagle3.volumeMounts" -}}
- name: config
  mountPath: /etc/eagle3
  readOnly: true
- name: work
  mountPath: /work
- name: model-cache
  mountPath: {{ .ctx.Values.modelCache.mountPath }}
{{- if .gpu }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- if .ctx.Values.store.pvc }}
- name: store
  mountPath: {{ .ctx.Values.store.mountPath }}
{{- end }}
{{- end }}

{{/* Placement of GPU pods: whole-node GPU count, selectors, tolerations, priority, runtime. */}}
{{- define "eagle3.gpuPlacement" -}}
{{- with .Values.scheduling.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.scheduling.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.scheduling.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.scheduling.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- end }}

{{/* GPU pods: the node's GPUs, and CPU and memory (the /dev/shm volume included) with requests = limits:
Guaranteed QoS, the last class the kubelet evicts under memory pressure. */}}
{{- define "eagle3.gpuResources" -}}
{{- $r := dict "cpu" (toString .Values.gpu.cpu) "memory" .Values.gpu.memory }}
{{- /* a quantity as a string: the kubernetes Python client (v37) refuses an integer quantity before sending */ -}}
{{- if gt (int .Values.gpu.perNode) 0 }}{{ $_ := set $r .Values.gpu.resourceName (toString (int .Values.gpu.perNode)) }}{{ end }}
limits:
  {{- toYaml $r | nindent 2 }}
requests:
  {{- toYaml $r | nindent 2 }}
{{- end }}

{{- define "eagle3.cpuResources" -}}
limits:
  cpu: {{ .Values.cpu.cpu | quote }}
  memory: {{ .Values.cpu.memory }}
requests:
  cpu: {{ .Values.cpu.cpu | quote }}
  memory: {{ .Values.cpu.memory }}
{{- end }}
