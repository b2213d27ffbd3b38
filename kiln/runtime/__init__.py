"""The runtime: memory plan, model driver, toolchain, artifact, runner and in-process loader.

    plan + kernels ─► memory.plan_memory ─► driver.model_source ─► toolchain (cached objects)
                  ─► artifact.build_artifact (model.kiln) ─► loader.load / bin/kiln-runner
"""
