# A replica Deployment: an engine and its Sluice scheduler in one pod. `include "sluice.replica"` with a dict of
# Values, Release, name (the Deployment's), role ("" for an aggregated replica, else prefill or decode: the
# scheduler's --role, a label and the selector), replicas and workerResources (the worker container's resources).
# templates/replica.yaml renders it once (aggregated) or twice (disagg.enabled: the prefill and decode pools).
# (A file named _* renders nothing itself: these lines are not in any manifest.)
{{- define "sluice.replica" -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ .name }}
  namespace: {{ .Release.Namespace }}
  labels: {app: replica, sluice.io/engine: {{ .Values.engine }}{{ if .role }}, sluice.io/role: {{ .role }}{{ end }}}
spec:
  replicas: {{ .replicas }}
  selector: {matchLabels: {app: replica{{ if .role }}, sluice.io/role: {{ .role }}{{ end }}}}
  strategy:
    type: RollingUpdate
    rollingUpdate: {maxUnavailable: 0, maxSurge: 1}
  template:
    metadata:
      labels: {app: replica, sluice.io/engine: {{ .Values.engine }}{{ if .role }}, sluice.io/role: {{ .role }}{{ end }}}
      annotations: {prometheus.io/scrape: "true"}
    spec:
      automountServiceAccountToken: false
      subdomain: replica
      terminationGracePeriodSeconds: {{ .Values.scheduler.terminationGracePeriodSeconds }}
      securityContext: {{ toYaml .Values.podSecurityContext | nindent 8 }}
      containers:
{{- if eq .Values.engine "vllm" }}
        # vLLM's own image, KV-cache events published on 5557 (replay on 5558), the API on the pod's loopback only.
        - name: vllm
          image: {{ .Values.images.vllm }}
          imagePullPolicy: {{ .Values.images.pullPolicy }}
          command: ["vllm", "serve", "{{ .Values.model.vllmModel }}", "--host", "127.0.0.1", "--port", "8000",
                    "--kv-events-config", '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv"}']
          args: {{ toJson .Values.vllm.extraArgs }}
          env:
            - {name: HOME, value: /tmp}
            - {name: VLLM_HOST_IP, value: 127.0.0.1}
          startupProbe:
            exec: {command: [python3, -c, "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=3)"]}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 90
          livenessProbe:
            exec: {command: [python3, -c, "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=3)"]}
            periodSeconds: 15
            timeoutSeconds: 5
            failureThreshold: 4
          securityContext: {{ toYaml .Values.containerSecurityContext | nindent 12 }}
          volumeMounts:
            - {name: models, mountPath: /models, readOnly: true}
            - {name: tmp, mountPath: /tmp}
            - {name: shm, mountPath: /dev/shm}
          resources:
            requests: {cpu: {{ .Values.vllm.resources.requests.cpu | quote }}, memory: {{ .Values.vllm.resources.requests.memory }}, nvidia.com/gpu: {{ .Values.vllm.gpus }}}
            limits: {cpu: {{ .Values.vllm.resources.limits.cpu | quote }}, memory: {{ .Values.vllm.resources.limits.memory }}, nvidia.com/gpu: {{ .Values.vllm.gpus }}}
        # The Sluice agent: the replica's scheduler driving vLLM through its API and KV events.
        - name: scheduler
          image: {{ .Values.images.registry }}sluice-scheduler:{{ .Values.images.tag }}
          imagePullPolicy: {{ .Values.images.pullPolicy }}
          # scheduler.extraArgs come last: a flag given twice takes its last value.
          args:
            - "--engine"
            - "vllm"
            - "--engine-url"
            - "http://127.0.0.1:8000"
            - "--engine-kv-events"
            - "tcp://127.0.0.1:5557"
            - "--engine-kv-replay"
            - "tcp://127.0.0.1:5558"
            - "--namespace"
            - "$(SLUICE_NAMESPACE)"
            - "--router"
            - "router:50052"
            - "--replica-id"
            - "$(POD_NAME)"
            - "--advertise-host"
            - "$(POD_NAME).replica.$(POD_NAMESPACE).svc.cluster.local"
            - "--metrics-port"
            - "{{ .Values.metrics.port }}"
            - "--drain-timeout"
            - "{{ .Values.scheduler.drainTimeout }}"
            - "--tls-dir"
            - "/etc/sluice/tls"
{{- if .Values.scheduler.extraArgs }}{{ toYaml .Values.scheduler.extraArgs | nindent 12 }}{{- end }}
{{- else }}
        - name: worker
          image: {{ .Values.images.registry }}sluice-worker:{{ .Values.images.tag }}
          imagePullPolicy: {{ .Values.images.pullPolicy }}
          # worker.extraArgs come last: a flag given twice takes its last value.
          args:
            - "--backend"
            - "{{ .Values.worker.backend }}"
            - "--model"
            - "/models/$(SLUICE_MODEL)"
{{- if .Values.worker.hostBlocks }}
            - "--host-blocks"
            - "{{ .Values.worker.hostBlocks }}"
{{- end }}
            - "--metrics-port"
            - "{{ .Values.metrics.workerPort }}"
            - "--tls-dir"
            - "/etc/sluice/tls"
{{- if .Values.worker.extraArgs }}{{ toYaml .Values.worker.extraArgs | nindent 12 }}{{- end }}
          envFrom: [{configMapRef: {name: sluice-env}}]
          ports: [{name: grpc, containerPort: 50061}, {name: worker-metrics, containerPort: {{ .Values.metrics.workerPort }}}]
          startupProbe:
            exec: {command: [python, -m, sluice.healthcheck, "50061", --role, worker]}
            periodSeconds: 5
            timeoutSeconds: 4
            failureThreshold: 120
          livenessProbe:
            exec: {command: [python, -m, sluice.healthcheck, "50061", --role, worker]}
            periodSeconds: 15
            timeoutSeconds: 4
            failureThreshold: 4
          securityContext: {{ toYaml .Values.containerSecurityContext | nindent 12 }}
          volumeMounts:
            - {name: models, mountPath: /models, readOnly: true}
            - {name: tls-worker, mountPath: /etc/sluice/tls, readOnly: true}
            - {name: tmp, mountPath: /tmp}
          resources: {{ toYaml .workerResources | nindent 12 }}
        - name: scheduler
          image: {{ .Values.images.registry }}sluice-scheduler:{{ .Values.images.tag }}
          imagePullPolicy: {{ .Values.images.pullPolicy }}
          # --kv-worker-address: the worker as other replicas' workers reach it to pull KV blocks (prefill/decode
          # hand-offs): this pod's DNS name, not the pod-local 127.0.0.1 the scheduler itself dials (the worker's
          # certificate must carry *.replica.<namespace>.svc.cluster.local, as the scheduler's does).
          # --role (disagg): the pool it serves; a prefill scheduler's per-request chunk cap is its whole round budget
          # (the cap bounds the decodes' inter-token latency, and none run there), as `sluice up --disagg` gives it.
          # scheduler.extraArgs come last: a flag given twice takes its last value.
          args:
            - "--worker"
            - "127.0.0.1:50061"
{{- if .role }}
            - "--role"
            - "{{ .role }}"
{{- end }}
{{- if eq .role "prefill" }}
            - "--max-prefill-chunk"
            - "{{ .Values.disagg.prefill.maxPrefillChunk }}"
{{- end }}
            - "--namespace"
            - "$(SLUICE_NAMESPACE)"
            - "--router"
            - "router:50052"
            - "--replica-id"
            - "$(POD_NAME)"
            - "--advertise-host"
            - "$(POD_NAME).replica.$(POD_NAMESPACE).svc.cluster.local"
            - "--kv-worker-address"
            - "$(POD_NAME).replica.$(POD_NAMESPACE).svc.cluster.local:50061"
            - "--metrics-port"
            - "{{ .Values.metrics.port }}"
            - "--drain-timeout"
            - "{{ .Values.scheduler.drainTimeout }}"
{{- if .Values.scheduler.hostPrefixCache }}
            - "--host-prefix-cache"
{{- end }}
            - "--tls-dir"
            - "/etc/sluice/tls"
{{- if .Values.scheduler.extraArgs }}{{ toYaml .Values.scheduler.extraArgs | nindent 12 }}{{- end }}
{{- end }}
          env:
            - {name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
            - {name: POD_NAMESPACE, valueFrom: {fieldRef: {fieldPath: metadata.namespace}}}
            - {name: REDIS_PASSWORD, valueFrom: {secretKeyRef: {name: sluice-redis-scheduler, key: password}}}
            - {name: SLUICE_REDIS_URL, value: "{{ .Values.redis.scheme }}://scheduler:$(REDIS_PASSWORD)@{{ .Values.redis.host }}:{{ .Values.redis.port }}/0"}
          envFrom: [{configMapRef: {name: sluice-env}}]
          ports: [{name: grpc, containerPort: 50071}, {name: metrics, containerPort: {{ .Values.metrics.port }}}]
          startupProbe:
            exec: {command: [python, -m, sluice.healthcheck, "50071", --role, scheduler]}
            periodSeconds: 5
            timeoutSeconds: 4
            failureThreshold: 180
          readinessProbe:
            exec: {command: [python, -m, sluice.healthcheck, "50071", --role, scheduler]}
            periodSeconds: 5
            timeoutSeconds: 4
          livenessProbe:
            exec: {command: [python, -m, sluice.healthcheck, "50071", --role, scheduler]}
            periodSeconds: 15
            timeoutSeconds: 4
            failureThreshold: 4
          securityContext: {{ toYaml .Values.containerSecurityContext | nindent 12 }}
          volumeMounts:
            - {name: tls-scheduler, mountPath: /etc/sluice/tls, readOnly: true}
            - {name: tmp, mountPath: /tmp}
          resources: {{ toYaml .Values.scheduler.resources | nindent 12 }}
      volumes:
        - {name: models, persistentVolumeClaim: {claimName: {{ .Values.model.claimName }}, readOnly: true}}
        - {name: tmp, emptyDir: {}}
{{- if eq .Values.engine "vllm" }}
        - {name: shm, emptyDir: {medium: Memory, sizeLimit: 2Gi}}
{{- else }}
        - name: tls-worker
          secret:
            secretName: sluice-tls-worker
            items: [{key: ca.crt, path: ca.pem}, {key: tls.crt, path: worker.pem}, {key: tls.key, path: worker-key.pem}]
{{- end }}
        - name: tls-scheduler
          secret:
            secretName: sluice-tls-scheduler
            items: [{key: ca.crt, path: ca.pem}, {key: tls.crt, path: scheduler.pem}, {key: tls.key, path: scheduler-key.pem}]
{{- end }}
