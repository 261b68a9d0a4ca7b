module kubeshard.io/hack/runc-wrapper

go 1.26.0
