# diond container image. Multi-stage: the build stage makes the release bundle
# (scripts/bundle.sh: the binaries with every library they load but glibc, the GCC runtime and
# NVIDIA's, each found through an $ORIGIN RUNPATH); the runtime stage unpacks that bundle onto
# the CUDA runtime image and installs no package, so the image holds what
# scripts/bare-root-check.sh runs in a bare Debian 13 root (docs/GPU.md "The bundle").
#
#   docker build -t diond .                       # release bundle: sm_80, sm_90, sm_100 + PTX
#   docker build --build-arg BUILD_CUDA=OFF -t diond:cpu .          # cpu bundle, no plugin
#   docker build --build-arg BUNDLE=given -t diond .  # the bundle at dist/diond.tar.xz, as made
#                                                    # by scripts/bundle.sh (e.g. the one CI ran)
#
# Note: Debian 12 is the development platform; NVIDIA publishes no Debian CUDA image, so the
# image is Ubuntu 24.04, whose package names match (glibc 2.39: newer than a Debian 12 bundle
# needs).
ARG CUDA_VERSION=13.0.0
ARG BASE_OS=ubuntu24.04
ARG BUNDLE=built

FROM nvidia/cuda:${CUDA_VERSION}-devel-${BASE_OS} AS build
ARG BUILD_CUDA=ON
WORKDIR /src
COPY scripts/install-deps.sh scripts/install-deps.sh
RUN bash scripts/install-deps.sh --build && rm -rf /var/lib/apt/lists/*
COPY . .
# The tests are built too: the bundle carries the gpu-labelled ones (scripts/gpu-check.sh).
RUN flavour=release; [ "$BUILD_CUDA" = ON ] || flavour=cpu; \
    DIOND_SKIP_DEPS=1 DIOND_JOBS=$(nproc) DIOND_BUNDLE_CMAKE_ARGS=-DCMAKE_BUILD_TYPE=Release \
      bash scripts/bundle.sh --flavour "$flavour" /out/diond.tar.xz

# The bundle the runtime stage takes: built above, or given in the build context.
FROM scratch AS bundle-built
COPY --from=build /out/diond.tar.xz /diond.tar.xz
FROM scratch AS bundle-given
COPY dist/diond.tar.xz /diond.tar.xz
# hadolint ignore=DL3006
FROM bundle-${BUNDLE} AS bundle

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${BASE_OS} AS runtime
COPY --from=bundle /diond.tar.xz /tmp/diond.tar.xz
# Unpack (one top folder, diond-<flavour>/) into /opt/diond, then check with ldd that every
# library of every binary resolves here: the bundle's inside /opt/diond/lib, the CUDA ones
# from this image (NVIDIA's libraries are never packed).
RUN mkdir -p /opt/diond \
 && tar -xJf /tmp/diond.tar.xz -C /opt/diond --strip-components=1 \
 && rm /tmp/diond.tar.xz \
 && bash /opt/diond/tools/check-libs.sh /opt/diond \
 && groupadd --system --gid 10001 diond \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/diond --create-home diond \
 && mkdir -p /run/diond && chown diond:diond /run/diond
# GOMP_SPINCOUNT, OPENBLAS_THREAD_TIMEOUT: idle OpenMP and OpenBLAS threads wait about 0.1 ms,
# then sleep, instead of spinning against each other and the trainer (docs/TOOLCHAIN.md P20, P21;
# the daemon sets the same when unset).
ENV PATH=/opt/diond/bin:$PATH \
    DIOND_TARGET=unix:/run/diond/diond.sock \
    GOMP_SPINCOUNT=10000 \
    OPENBLAS_THREAD_TIMEOUT=18
# By uid: a name the host cannot resolve would not do for runAsNonRoot checks.
USER 10001:10001
EXPOSE 50551 9464
# gRPC health (grpc.health.v1) over the Unix socket, through diondctl.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["/opt/diond/bin/diondctl", "--timeout=3s", "health"]
# Inside a pod the sidecar is reached over the shared Unix socket; TCP stays on loopback.
ENTRYPOINT ["/opt/diond/bin/diond"]
CMD ["--listen=unix:/run/diond/diond.sock,127.0.0.1:50551", "--metrics_address=0.0.0.0:9464"]
