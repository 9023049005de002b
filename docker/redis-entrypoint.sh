#!/bin/sh
# The redis target's entrypoint, as the official redis image's: as root, own the data
# folder and run the arguments as the redis user; as any other user, run them as is.
set -eu
if [ "$(id -u)" = "0" ]; then
  chown -R redis:redis /data
  exec setpriv --reuid=redis --regid=redis --init-groups "$@"
fi
exec "$@"
