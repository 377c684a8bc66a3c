#!/bin/sh
# Build devstack/linkemu/build/linkemu (idempotent: rebuilds only when linkemu.c is newer).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$here/build"
if [ ! -x "$here/build/linkemu" ] || [ "$here/linkemu.c" -nt "$here/build/linkemu" ]; then
    # a temporary of this build's own: two first builds at once must not move each other's file
    ${CC:-cc} -O2 -Wall -Wextra -o "$here/build/linkemu.tmp.$$" "$here/linkemu.c" -lpthread -lm
    mv -f "$here/build/linkemu.tmp.$$" "$here/build/linkemu"
fi
echo "$here/build/linkemu"
