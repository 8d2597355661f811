# The node part of scripts/testenv (`scripts/testenv node up|down|env|import`), sourced by it: it uses the bed's
# settings (NODE_*, POD_CIDR, SERVICE_CIDR, STATE, BIN) and helpers (log, die, start, wait_for).
# shellcheck shell=bash

# --- the node: kubelet + containerd + runc + CNI, so that pods really run ---------------------------------------
#
# Everything of the node runs in one mount + network namespace of its own (held by an `unshare` process), so the
# machine's network, its /run, /var/lib, /var/log and its kernel settings stay as they were: inside, the bridge
# pelican0 carries the node's address, CNI's bridge cni0 the pods', kube-proxy's iptables rules live there, and the
# sysctls the kubelet insists on are files bind-mounted over /proc/sys. The API server stays on the machine's
# loopback; a socat pair joins the node's address to it through a unix socket. kube-controller-manager and
# kube-scheduler need no node network and run beside the API server. What the node changes outside its namespace:
# the kubepods cgroups (removed on `node down`).

NODE=$STATE/node

ensure_node_packages() {
  command -v containerd >/dev/null && command -v runc >/dev/null && [[ -x /usr/lib/cni/bridge ]] &&
    command -v socat >/dev/null && command -v iptables >/dev/null && command -v conntrack >/dev/null &&
    command -v gcc >/dev/null && command -v ip >/dev/null && command -v nsenter >/dev/null && return
  log "installing containerd, runc, the CNI plugins, socat, iptables and conntrack from Debian's packages"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends containerd runc \
    containernetworking-plugins socat iptables conntrack iproute2 util-linux gcc libc6-dev >/dev/null
}

node_pid() { cat "$STATE/pids/node.pid" 2>/dev/null; }

# in_node CMD...: runs CMD inside the node's namespaces.
in_node() { nsenter --target "$(node_pid)" --mount --net -- "$@"; }

node_images() {
  local images=$CACHE/images root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  mkdir -p "$images"
  [[ -f $images/pause.tar && $images/pause.tar -nt $root/hack/pause.c ]] || "$root/scripts/image" pause "$images/pause.tar" >&2
  [[ -f $images/redis.tar && $images/redis.tar -nt $(command -v redis-server) ]] ||
    "$root/scripts/image" redis "$images/redis.tar" >&2
  ctr --address "$NODE/containerd.sock" -n k8s.io images import "$images/pause.tar" >/dev/null
  ctr --address "$NODE/containerd.sock" -n k8s.io images import "$images/redis.tar" >/dev/null
}

node_configs() {
  local api_port ca=$STATE/pki/apiserver.crt part
  api_port=$(cat "$STATE/api_port")
  mkdir -p "$NODE"/{containerd,kubelet,cni/net.d,cni/ipam,var-lib,var-log,sysctl}
  for part in node:kubelet proxy:kube-proxy; do
    kubeconfig "$NODE/${part#*:}.kubeconfig" "https://$NODE_IP:$api_port" "$ca" "$(cat "$STATE/pki/${part%%:*}.token")"
  done
  for part in controller-manager scheduler; do
    kubeconfig "$NODE/$part.kubeconfig" "https://127.0.0.1:$api_port" "$ca" "$(cat "$STATE/pki/$part.token")"
  done

  cat >"$NODE/containerd.toml" <<TOML
version = 2
root = "$NODE/containerd/root"
state = "$NODE/containerd/state"
# Plugins that would write outside the node's directories or that this machine cannot use.
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$NODE/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:bed"
  # No CAP_SYS_RESOURCE here: runc cannot lower oom_score_adj below containerd's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$NODE/cni/net.d"
TOML

  cat >"$NODE/cni/net.d/10-pelican.conflist" <<JSON
{
  "cniVersion": "0.4.0",
  "name": "pelican",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}],
              "dataDir": "$NODE/cni/ipam"}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON

  cat >"$NODE/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine has cgroup v1 (hybrid); the kubelet refuses it unless told otherwise.
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$NODE/containerd.sock
# The kubelet's default (-999) needs CAP_SYS_RESOURCE, which this machine does not grant.
oomScoreAdj: 0
address: $NODE_IP
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
authorization:
  mode: Webhook
podCIDR: $POD_CIDR
resolvConf: /etc/resolv.conf
failSwapOn: false
# The machine's disk is shared with everything else on it: no evictions or image collection because of it.
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
YAML

  cat >"$NODE/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: $NODE/kube-proxy.kubeconfig
hostnameOverride: $NODE_NAME
mode: iptables
clusterCIDR: $POD_CIDR
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
# Zero leaves the conntrack table size and timeouts as they are (they are not all per network namespace).
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
YAML
}

# kubeconfig FILE SERVER CA TOKEN
kubeconfig() {
  KUBECONFIG=$1 "$BIN/kubectl" config set-cluster bed --server "$2" --certificate-authority "$3" --embed-certs >/dev/null
  KUBECONFIG=$1 "$BIN/kubectl" config set-credentials bed --token "$4" >/dev/null
  KUBECONFIG=$1 "$BIN/kubectl" config set-context bed --cluster bed --user bed >/dev/null
  KUBECONFIG=$1 "$BIN/kubectl" config use-context bed >/dev/null
}

# The namespaces' inside: private /run, /var/lib and /var/log (containerd, CNI and the kubelet write there), the
# kernel settings the kubelet wants as files, loopback, the node's bridge, forwarding.
node_namespace() {
  local setting value
  in_node mount --make-rshared /
  in_node mount -t tmpfs -o mode=755 pelican-node-run /run
  in_node mount --bind "$NODE/var-lib" /var/lib
  in_node mount --bind "$NODE/var-log" /var/log
  while read -r setting value; do
    echo "$value" >"$NODE/sysctl/$setting"
    in_node mount --bind "$NODE/sysctl/$setting" "/proc/sys/${setting//.//}"
  done <<SYSCTL
vm.overcommit_memory 1
vm.panic_on_oom 0
kernel.panic 10
kernel.panic_on_oops 1
kernel.keys.root_maxkeys 1000000
kernel.keys.root_maxbytes 25000000
SYSCTL
  in_node ip link set lo up
  in_node ip link add pelican0 type bridge
  in_node ip addr add "$NODE_IP/24" dev pelican0
  in_node ip link set pelican0 up
  in_node ip route add default dev pelican0
  in_node sysctl -qw net.ipv4.ip_forward=1
}

cmd_node_up() {
  is_up || die "the test bed is not up: run scripts/testenv up first"
  if [[ -f $STATE/pids/node.pid ]] && kill -0 "$(node_pid)" 2>/dev/null; then
    log "node already up"
    return
  fi
  # One node per machine: the kubelet's cgroups (kubepods) are the machine's.
  [[ -z $(ls -d /sys/fs/cgroup/*/kubepods 2>/dev/null) ]] ||
    die "another node runs on this machine (/sys/fs/cgroup/*/kubepods exists); stop it with its scripts/testenv node down"
  # The kubelet evicts pods when its disk has less than 1% free, and containerd needs room for the images: say so
  # here rather than as pods that never become Ready.
  local free_kib
  free_kib=$(df --output=avail -k "$STATE" | tail -1)
  ((free_kib > 5 * 1024 * 1024)) ||
    die "the node needs 5 GiB free on the disk of $STATE; $((free_kib / 1024)) MiB are: free some (cargo clean, old clones)"
  local start=$SECONDS api_port
  ensure_node_packages
  build_kubernetes
  api_port=$(cat "$STATE/api_port")
  node_configs
  start node unshare --mount --net --fork sleep infinity
  sleep 0.2
  node_namespace

  local enter=(nsenter --target "$(node_pid)" --mount --net --)
  start node-containerd "${enter[@]}" containerd --config "$NODE/containerd.toml"
  wait_for node-containerd 60 ctr --address "$NODE/containerd.sock" version
  node_images
  start node-api-socket socat "UNIX-LISTEN:$NODE/apiserver.sock,fork,mode=600" "TCP:127.0.0.1:$api_port"
  start node-api-address "${enter[@]}" socat "TCP-LISTEN:$api_port,bind=$NODE_IP,fork,reuseaddr" \
    "UNIX-CONNECT:$NODE/apiserver.sock"
  start node-controller-manager "$BIN/kube-node" kube-controller-manager --kubeconfig "$NODE/controller-manager.kubeconfig" \
    --use-service-account-credentials --root-ca-file "$STATE/pki/apiserver.crt" \
    --service-account-private-key-file "$STATE/pki/sa.key" --leader-elect=false \
    --bind-address 127.0.0.1 --secure-port "$(free_port)"
  start node-scheduler "$BIN/kube-node" kube-scheduler --kubeconfig "$NODE/scheduler.kubeconfig" --leader-elect=false \
    --bind-address 127.0.0.1 --secure-port "$(free_port)"
  start node-kubelet "${enter[@]}" "$BIN/kube-node" kubelet --config "$NODE/kubelet.yaml" \
    --kubeconfig "$NODE/kubelet.kubeconfig" --root-dir "$NODE/kubelet" --hostname-override "$NODE_NAME" \
    --node-ip "$NODE_IP"
  start node-proxy "${enter[@]}" "$BIN/kube-node" kube-proxy --config "$NODE/kube-proxy.yaml"
  wait_for node-kubelet 240 "$BIN/kubectl" --kubeconfig "$STATE/kubeconfig" wait --for=condition=Ready \
    "node/$NODE_NAME" --timeout=1s
  # The controller-manager works: it gave the default namespace its ServiceAccount (pods need one).
  wait_for node-controller-manager 240 "$BIN/kubectl" --kubeconfig "$STATE/kubeconfig" get serviceaccount default
  cat >"$NODE/env" <<ENV
export PELICAN_NODE=$NODE_NAME
export PELICAN_NODE_PID=$(node_pid)
export PELICAN_CONTAINERD=$NODE/containerd.sock
ENV
  log "node $NODE_NAME Ready in $((SECONDS - start))s; its logs are in $STATE/logs/node-*.log and $NODE/var-log"
}

# Every process of the node: those in its mount namespace (containerd, its shims, the kubelet...) and the
# containers' (in the kubepods cgroups).
node_processes() {
  local mnt pid
  mnt=$(readlink "/proc/$(node_pid)/ns/mnt") || return 0
  for pid in /proc/[0-9]*; do
    [[ $(readlink "$pid/ns/mnt" 2>/dev/null) == "$mnt" ]] && echo "${pid#/proc/}"
  done
  find /sys/fs/cgroup/*/kubepods -name cgroup.procs -exec cat {} + 2>/dev/null || true
}

cmd_node_down() {
  [[ -f $STATE/pids/node.pid ]] || return 0
  local part pids
  for part in kubelet proxy controller-manager scheduler api-socket; do
    [[ -f $STATE/pids/node-$part.pid ]] && kill -- "-$(cat "$STATE/pids/node-$part.pid")" 2>/dev/null
    rm -f "$STATE/pids/node-$part.pid"
  done
  for _ in 1 2 3 4 5; do
    pids=$(node_processes | sort -u)
    [[ -z $pids ]] && break
    # shellcheck disable=SC2086
    kill -9 $pids 2>/dev/null || true
    sleep 0.5
  done
  for _ in 1 2 3 4 5; do
    find /sys/fs/cgroup/*/kubepods -depth -type d -exec rmdir {} + 2>/dev/null || true
    [[ -z $(ls -d /sys/fs/cgroup/*/kubepods 2>/dev/null) ]] && break
    sleep 0.5
  done
  rm -f "$STATE"/pids/node*.pid
  rm -rf "$NODE"
  log "node down"
}

# What a failed node test needs to be understood after the bed is gone: the node's conditions and taints, the pods
# that are not running and why, the last Warning events, the images containerd holds, the disk, and the kubelet's
# last errors.
cmd_node_explain() {
  local kubectl=("$BIN/kubectl" --kubeconfig "$STATE/kubeconfig")
  echo "== the node: conditions and taints"
  "${kubectl[@]}" get nodes -o jsonpath='{range .items[*]}{.metadata.name}: {range .status.conditions[*]}{.type}={.status} {end}taints={.spec.taints}{"\n"}{end}' || true
  echo "== pods not Running"
  "${kubectl[@]}" get pods -A --field-selector=status.phase!=Running -o wide 2>&1 | head -30 || true
  echo "== the last Warning events"
  "${kubectl[@]}" get events -A --field-selector=type=Warning --sort-by=.lastTimestamp 2>&1 | tail -30 || true
  echo "== images on the node"
  ctr --address "$NODE/containerd.sock" -n k8s.io images ls -q 2>&1 | grep -v '^sha256:' || true
  echo "== disk"
  df -h "$STATE" /var/lib 2>&1 || true
  echo "== the kubelet's last errors"
  grep -E '^E[0-9]{4}' "$STATE/logs/node-kubelet.log" 2>/dev/null | tail -20 || true
}

cmd_node() {
  case "${1:-}" in
    up) cmd_node_up ;;
    down) cmd_node_down ;;
    explain) cmd_node_explain ;;
    env) cat "$NODE/env" 2>/dev/null || die "the node is not up: run scripts/testenv node up" ;;
    import)
      shift
      [[ -S $NODE/containerd.sock ]] || die "the node is not up: run scripts/testenv node up"
      local tar
      for tar in "$@"; do
        ctr --address "$NODE/containerd.sock" -n k8s.io images import "$tar" >/dev/null
        log "imported $tar"
      done
      ;;
    *) die "usage: scripts/testenv node up|down|env|explain|import IMAGE.tar..." ;;
  esac
}
