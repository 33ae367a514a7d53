# diond container image. Multi-stage: build on the CUDA devel image, run on the matching runtime
# image. Uses the same dependency script and build script as CI (scripts/install-deps.sh,
# scripts/build.sh). The CUDA plugin is built when BUILD_CUDA=ON (default); the daemon binary
# itself links no CUDA library and runs on CPU-only nodes too.
#
#   docker build -t diond .                       # with the CUDA plugin
#   docker build --build-arg BUILD_CUDA=OFF -t diond:cpu .
#
# Note: Debian 12 is the development platform; NVIDIA publishes no Debian CUDA image, so the
# image is Ubuntu 24.04, whose package names match.
ARG CUDA_VERSION=13.0.0
ARG BASE_OS=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${BASE_OS} AS build
ARG BUILD_CUDA=ON
WORKDIR /src
COPY scripts/install-deps.sh scripts/install-deps.sh
RUN bash scripts/install-deps.sh --build && rm -rf /var/lib/apt/lists/*
COPY . .
RUN DIOND_SKIP_DEPS=1 DIOND_JOBS=$(nproc) bash scripts/build.sh /build \
      -DCMAKE_BUILD_TYPE=Release -DDIOND_WITH_CUDA=${BUILD_CUDA} \
      -DDIOND_BUILD_TESTS=OFF -DDIOND_BUILD_BENCHMARKS=OFF \
 && mkdir -p /out/bin && cp /build/bin/* /out/bin/

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${BASE_OS} AS runtime
COPY scripts/install-deps.sh /tmp/install-deps.sh
RUN bash /tmp/install-deps.sh --runtime && rm -rf /var/lib/apt/lists/* /tmp/install-deps.sh \
 && useradd --system --uid 10001 --home-dir /var/lib/diond --create-home diond \
 && mkdir -p /run/diond && chown diond:diond /run/diond
COPY --from=build /out/bin/ /opt/diond/bin/
# GOMP_SPINCOUNT, OPENBLAS_THREAD_TIMEOUT: idle OpenMP and OpenBLAS threads wait about 0.1 ms,
# then sleep, instead of spinning against each other and the trainer (docs/TOOLCHAIN.md P20, P21;
# the daemon sets the same when unset).
ENV PATH=/opt/diond/bin:$PATH \
    DIOND_TARGET=unix:/run/diond/diond.sock \
    GOMP_SPINCOUNT=10000 \
    OPENBLAS_THREAD_TIMEOUT=18
USER diond
EXPOSE 50551 9464
# gRPC health (grpc.health.v1) over the Unix socket, through diondctl.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["/opt/diond/bin/diondctl", "--timeout=3s", "health"]
# Inside a pod the sidecar is reached over the shared Unix socket; TCP stays on loopback.
ENTRYPOINT ["/opt/diond/bin/diond"]
CMD ["--listen=unix:/run/diond/diond.sock,127.0.0.1:50551", "--metrics_address=0.0.0.0:9464"]
