# kpipe's image: a drop-in for kube-proxy's (see deploy/).
#
# How this was checked: docker was not available where this file was written.
# The build stage's command was run as is from the repository root with Go
# 1.26 (CGO_ENABLED=0 GOWORK=off go build -trimpath -o /out/kpipe ./cmd/kpipe,
# with /out a temporary directory) and built a static binary;
# deploy/iptables-wrapper.sh was run in throwaway network namespaces holding
# legacy rules, nft rules and the kubelet's hint chains. The runtime stage's
# apt-get line and the image as a whole were not run.

FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# GOWORK=off: the workspace's other module (tools/) is not needed for kpipe.
RUN CGO_ENABLED=0 GOWORK=off go build -trimpath -o /out/kpipe ./cmd/kpipe

# Debian's iptables package has both backends (iptables-legacy, iptables-nft)
# under update-alternatives, which the wrapper switches at start.
FROM debian:trixie-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables nftables conntrack iproute2 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/kpipe /usr/local/bin/kpipe
COPY deploy/iptables-wrapper.sh /usr/local/bin/iptables-wrapper.sh
# Fail the build if either backend is missing.
RUN iptables-legacy --version && iptables-nft --version \
 && ip6tables-legacy --version && ip6tables-nft --version
ENTRYPOINT ["/usr/local/bin/iptables-wrapper.sh", "/usr/local/bin/kpipe"]
