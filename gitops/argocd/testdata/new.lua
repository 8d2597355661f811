-- Just applied: the operator has not written any status yet.
return {["apiVersion"] = "pelican.io/v1alpha1", ["kind"] = "ConsumerGroupPolicy", ["metadata"] = {["name"] = "new", ["namespace"] = "apps", ["generation"] = 1}, ["spec"] = {["stream"] = "s", ["group"] = "g"}}
