# kpipe's image: a drop-in for kube-proxy's (see deploy/). kubeadm's DaemonSet
# runs /usr/local/bin/kube-proxy with kube-proxy's flags, bypassing any
# ENTRYPOINT: that path is kpipe, and iptables, iptables-save,
# iptables-restore and their ip6tables twins are the iptables-wrapper, which
# picks the host's backend (legacy or nft) the first time anything runs one of
# them, as kube-proxy's image does. kpipe's first call is `iptables -V`.
#
#   go tool task image        (buildah; stamps git's version and commit)
#   buildah build --build-arg VERSION=v0.1.0 --build-arg GIT_COMMIT=$(git rev-parse HEAD) -t kpipe:v0.1.0 .
#
# BASE and GO_IMAGE name the base images, so that a machine without a
# registry can build on images it imported itself (e2e/cluster builds on a
# debootstrapped localhost/debian:bookworm and localhost/golang:1.26).
#
# BASE is Debian bookworm, as upstream kube-proxy's distroless-iptables is:
# its iptables 1.8.9 encodes rules in the kernel exactly as kpipe's netlink
# writer does (netfilter's TestNetlinkWriterEqualsRestore, run with this
# image's binaries by e2e/cluster). iptables 1.8.11 (trixie) lists the same
# rules but stores them differently (addresses before the protocol, IPv4's
# protocol as a header read), so kpipe's own digests of what it wrote would
# not be those of chains that the image's iptables-restore wrote.
#
# Checked here: e2e/cluster builds this file with buildah (chroot isolation:
# crun refuses this host's hybrid cgroups) and runs it under a kubelet in
# place of kubeadm's kube-proxy (e2e/clustertest). e2e
# TestDeployIPTablesWrapper runs the wrapper on the host's iptables;
# TestDeployImageRunsKubeadmsCommand checks this file against deploy/'s
# DaemonSet.

ARG GO_IMAGE=golang:1.26
ARG BASE=debian:bookworm-slim

FROM ${GO_IMAGE} AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# Stamped into --version and kpipe_build_info (.dockerignore leaves .git out,
# so the commit comes from here too).
ARG VERSION=v0.0.0-dev
ARG GIT_COMMIT=unknown
ARG GIT_TREE_STATE=unknown
ARG BUILD_DATE=unknown
# GOWORK=off: go.mod alone (go.work and tools/, go-task's module, are not in
# the context). CI builds through go.work; go.mod requires the versions the
# workspace selects, so both build the same modules (cmd/kpipe's
# TestWorkspaceBuildsTheImagesVersions fails when they differ).
RUN CGO_ENABLED=0 GOWORK=off go build -trimpath \
      -ldflags "-X main.gitVersion=${VERSION} -X main.gitCommit=${GIT_COMMIT} -X main.gitTreeState=${GIT_TREE_STATE} -X main.buildDate=${BUILD_DATE}" \
      -o /out/kpipe ./cmd/kpipe \
 && /out/kpipe --version

# Debian's iptables package has both backends, xtables-legacy-multi and
# xtables-nft-multi, in /usr/sbin, where the wrapper looks for them.
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables nftables conntrack iproute2 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/kpipe /usr/local/bin/kpipe
COPY deploy/iptables-wrapper.sh /usr/sbin/iptables-wrapper
# kube-proxy's path is kpipe (which runs the same under either name), and the
# six iptables commands become links to the wrapper. Fail the build if either
# backend is missing.
RUN ln -s kpipe /usr/local/bin/kube-proxy \
 && /usr/sbin/iptables-wrapper --install \
 && xtables-legacy-multi iptables --version && xtables-nft-multi iptables --version \
 && xtables-legacy-multi ip6tables --version && xtables-nft-multi ip6tables --version \
 && /usr/local/bin/kube-proxy --version
ENTRYPOINT ["/usr/local/bin/kube-proxy"]
