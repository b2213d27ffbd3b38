/* LD_PRELOAD shim of the stand-in phone (adb_peer.py): a shell started with it runs aarch64 ELF
 * executables under qemu-aarch64, as if this machine were the phone, without binfmt_misc.
 *
 * execve(path, argv, envp) of an aarch64 ELF file becomes
 *   execve($KILN_PEER_QEMU, [qemu, -L, $KILN_PEER_SYSROOT, -U, LD_PRELOAD, -0, argv[0], path,
 *          argv[1], ...], envp)
 * Anything else is executed unchanged. Only what calls execve through the PLT is covered: the
 * shell (dash) does, which is all the stand-in phone needs.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int (*execve_fn)(const char *, char *const[], char *const[]);

static int is_aarch64_elf(const char *path) {
    unsigned char h[EI_NIDENT + 4];
    ssize_t n;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    n = read(fd, h, sizeof h);
    close(fd);
    if (n < (ssize_t)sizeof h || memcmp(h, ELFMAG, SELFMAG) != 0 || h[EI_DATA] != ELFDATA2LSB)
        return 0;
    return (h[EI_NIDENT + 2] | h[EI_NIDENT + 3] << 8) == EM_AARCH64;
}

int execve(const char *path, char *const argv[], char *const envp[]) {
    static execve_fn real;
    const char *qemu = getenv("KILN_PEER_QEMU");
    const char *sysroot = getenv("KILN_PEER_SYSROOT");
    if (!real) real = (execve_fn)dlsym(RTLD_NEXT, "execve");
    if (qemu && sysroot && is_aarch64_elf(path)) {
        size_t argc = 0, i, k = 0;
        char **args;
        while (argv[argc]) argc++;
        args = calloc(argc + 9, sizeof *args);
        if (!args) { errno = ENOMEM; return -1; }
        args[k++] = (char *)qemu;
        args[k++] = "-L";
        args[k++] = (char *)sysroot;
        args[k++] = "-U";
        args[k++] = "LD_PRELOAD";
        args[k++] = "-0";
        args[k++] = argc ? argv[0] : (char *)path;
        args[k++] = (char *)path;
        for (i = 1; i < argc; i++) args[k++] = argv[i];
        args[k] = NULL;
        real(qemu, args, envp);
        free(args);
        return -1;
    }
    return real(path, argv, envp);
}
