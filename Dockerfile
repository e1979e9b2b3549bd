# capper's container image: a static, non-root binary on distroless (CA certificates, no shell).
#   docker build --build-arg VERSION=v1.2.3 --build-arg REVISION=$(git rev-parse HEAD) -t capper:v1.2.3 .
# The build stage runs scripts/build.sh, the same release build `make build` runs and the tests check
# (static, -trimpath, empty build id, version stamped, time zones embedded).
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
ARG REVISION=unknown
RUN REVISION=$REVISION scripts/build.sh /out/capper "$VERSION"

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/capper /capper
USER 65532:65532
EXPOSE 9090
ENTRYPOINT ["/capper"]
CMD ["run", "--config", "/etc/capper/capper.yaml"]
