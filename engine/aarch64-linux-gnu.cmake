# CMake toolchain for cross-building llama-server for aarch64 Linux (make arm).
#
# Compilers and sysroot are Debian's cross toolchain (g++-aarch64-linux-gnu):
# its libc, libstdc++ and libgomp live in /usr/aarch64-linux-gnu, the same
# Debian packages an arm64 board runs. The CPU flags are not set here: the
# Makefile passes GGML_NATIVE=OFF and GGML_CPU_ARM_ARCH per board profile.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
# Anything the configure step has to run goes through qemu-user (qemu-user-static).
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64-static -L /usr/aarch64-linux-gnu)
