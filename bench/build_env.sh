# Sourced by the build scripts. The extension must share libtorch's C++ runtime (libstdc++ linked
# dynamically): a compiler that links it statically makes every C++ exception crossing into torch (any
# failed check) crash the process. Prefer the system compiler when CC/CXX name another one.
if [ -x /usr/bin/g++ ] && [ "${CXX:-/usr/bin/g++}" != /usr/bin/g++ ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++
fi
