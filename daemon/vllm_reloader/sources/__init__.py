"""Where candidates come from: a local root watched and rescanned (`local`), an object-store
prefix polled (`remote`, `objstore`) and downloaded (`download`) into a cache (`cache`)."""
