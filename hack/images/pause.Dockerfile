# The pod sandbox image containerd's CRI starts first in every pod (its name is the
# sandbox_image of the local node's containerd config). Context: hack/node-tools.sh's
# bin folder, which holds the static pause binary.
FROM scratch
COPY pause /pause
USER 65535:65535
ENTRYPOINT ["/pause"]
