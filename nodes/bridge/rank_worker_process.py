"""A worker rank's process (nodes/bridge/rank_workers.py starts it): ComfyUI imported as a library with the ComfyUI
process's own settings, this package under the name ComfyUI gave it, then rank_workers.worker_main.

    python rank_worker_process.py SOCKET RANK WORLD_SIZE COMFYUI_PATH   (the authkey, in hex, on stdin's first line)
"""
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import sys


def main() -> None:
    address, rank, world_size, comfyui = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    authkey = bytes.fromhex(sys.stdin.readline().strip())  # not on the command line: that any local user reads
    multiprocessing.current_process().authkey = authkey  # receives shared-memory file descriptors from rank 0
    sys.path.insert(0, comfyui)
    import comfy.options

    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args

    connection = multiprocessing.connection.Client(address, authkey=authkey)
    connection.send(rank)
    bootstrap = connection.recv()
    for key, value in bootstrap["args"].items():
        setattr(args, key, value)
    if args.cpu is False and os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(rank)  # before ComfyUI picks its device (the current one)
    import comfy.model_management  # reads args at import
    import folder_paths  # noqa: F401 - ComfyUI's model folders, before the package's modules read them

    package, root = bootstrap["package"], bootstrap["package_root"]
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(package, os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module
        spec.loader.exec_module(module)
    workers = importlib.import_module(f"{package}.nodes.bridge.rank_workers")
    torch = sys.modules["torch"]
    torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    workers.worker_main(connection, rank, world_size)


if __name__ == "__main__":
    main()
